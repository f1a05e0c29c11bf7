"""`mtune plan`'s own options (and `mtune run --fit`'s budgets): read from the command line and refused, each in one
line, before anything is planned: a combination only --fit reads, a valued option left without its value, an output
path that cannot be written, a recipe that trains nothing, a --fit budget the allocator's margin leaves nothing of."""

from __future__ import annotations

import os
from pathlib import Path

from mtune._cli.catalog import is_training_recipe
from mtune._cli.errors import CliError, UsageError

_VALUED = ("--device-memory", "--host-memory", "--json", "--png", "--nproc_per_node", "--output", "--maximize")

# What each valued option takes, for the line that refuses a missing value.
_EXPECTS = {"--device-memory": "a size such as 24GiB", "--host-memory": "a size such as 64GiB",
            "--json": "a file to write", "--png": "a .png file to write", "--nproc_per_node": "a number of ranks",
            "--output": "a file to write"}


def _maximize_values() -> tuple[str, ...]:
    from mtune.training.planning.longest import MAXIMIZE  # imports torch: only when --maximize is given

    return MAXIMIZE


def refuse_a_recipe_that_trains_nothing(module, recipe: str, command: str, hint: str) -> None:
    """``mtune plan`` and ``--fit`` plan training steps: a recipe that trains nothing (generate, merge_lora) is
    refused in one line, before its config is read."""
    if not is_training_recipe(module):
        raise UsageError(f"{command} plans the training recipes; {recipe} is not one (it trains nothing)", hint)


def check_writable(path: Path, flag: str, example: str) -> None:
    """Refuse, before any planning, an output path that cannot be written: a directory, a path whose directory
    does not exist (or is not a directory), or one this user may not write; the line names ``flag``, the path and
    the reason."""
    where = f"{flag} {path}"
    if path.is_dir():
        raise CliError(f"{where}: cannot write it: Is a directory", f"name a file, e.g. {path / example}")
    parent = path.parent
    if not parent.exists():
        raise CliError(f"{where}: cannot write it: {parent}: No such file or directory",
                       "create the directory first, or name a file in an existing one")
    if not parent.is_dir():
        raise CliError(f"{where}: cannot write it: {parent}: Not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"{where}: cannot write it: {path if path.exists() else parent}: Permission denied",
                       "name a file in a directory you can write")


def write_or_refuse(path: Path, flag: str, write):
    """``write(path)``, with an operating-system failure that :func:`check_writable` did not foresee said in one
    line naming ``flag`` and the path."""
    try:
        return write(path)
    except OSError as err:
        raise CliError(f"{flag} {path}: cannot write it: {err.strerror or err}") from err


def refuse_a_budget_within_the_margin(device_memory: int, given: str, error: type[Exception] = UsageError) -> None:
    """``--fit`` keeps the allocator's margin (`mtune.training.planning.fit.allocator_margin`, max(1 GiB, 5%)) out
    of the device budget, on every target (a CPU plan too): a budget at or below it leaves nothing to fit, so it is
    refused in one line before the search. ``given`` names where the budget came from (``--device-memory=40MiB``)."""
    from mtune.training.planning.fit import allocator_margin
    from mtune.units import format_bytes

    margin = allocator_margin(device_memory)
    if device_memory <= margin:
        raise error(f"{given} leaves nothing after the allocator's margin of {format_bytes(margin)} that --fit "
                    f"keeps: give more than {format_bytes(margin)}",
                    "the margin is max(1 GiB, 5% of the budget), headroom for the caching allocator (docs/plan.md, "
                    "'Budgets')")


def parse_plan_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Take the planner's own options out of ``argv`` (before or after RECIPE); the rest is
    ``RECIPE --config C overrides``, as for ``mtune run``."""
    options: dict = {"fit": False}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in ("-h", "--help"):
            options["help"] = True
        elif name in ("--fit", "--lossless-only", "--allow-lossy", "--from-data"):
            options[name.lstrip("-").replace("-", "_")] = True
        elif name in _VALUED:
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    expects = (f"one of {', '.join(_maximize_values())}" if name == "--maximize"
                               else _EXPECTS[name])
                    raise UsageError(f"{name} needs a value ({expects})" + (
                        f", not the option {argv[i + 1]}" if i + 1 < len(argv) else ""))
                value = argv[i + 1]
                i += 1
            options[name.lstrip("-").replace("-", "_")] = value
        elif argv[i].startswith("-") and argv[i] not in ("--config", "-c") and not argv[i].startswith("--config="):
            raise UsageError(f"unknown option {name}", "`mtune plan --help` lists the options")
        else:
            rest.append(argv[i])
        i += 1
    return options, rest


def check_options(options: dict) -> None:
    """Every refusal that needs neither the recipe nor the config: the options' combinations, --maximize's value,
    the output paths (writable before a plan or search is spent on them)."""
    fit = options["fit"]
    if (options.get("lossless_only") or options.get("allow_lossy")) and not fit:
        raise UsageError("--lossless-only and --allow-lossy choose what --fit may give up: add --fit")
    if options.get("lossless_only") and options.get("allow_lossy"):
        raise UsageError("--lossless-only and --allow-lossy contradict each other: give one")
    if "maximize" in options and not fit:
        raise UsageError(f"--maximize {options['maximize']} chooses what --fit maximizes: add --fit")
    if "output" in options and not fit:
        raise UsageError(f"--output {options['output']} is where --fit writes the config it finds: add --fit",
                         "without --fit, --json FILE writes the plan")
    if fit and options.get("from_data"):
        raise UsageError("--from-data with --fit: --fit searches at tokenizer.max_seq_len; run --from-data alone to "
                         "see the longest batch, then --fit with tokenizer.max_seq_len=N")
    if fit:
        given = [flag for flag in ("--json", "--png") if flag.lstrip("-") in options]
        if given:
            they, them = ("they write", "them") if len(given) > 1 else ("it writes", "it")
            raise UsageError(f"{' and '.join(given)}: {they} the plan of the config as given, which --fit does not "
                             f"make: drop {them}",
                             "--fit writes its answer to --output; `mtune plan --json FILE` on that config writes "
                             "its plan")
        if "device_memory" not in options:
            raise UsageError("--fit needs --device-memory SIZE (the memory of the device to fit, e.g. 24GiB)")
    if "maximize" in options and options["maximize"] not in _maximize_values():
        raise UsageError(f"--maximize {options['maximize']}: --fit can maximize {', '.join(_maximize_values())} "
                         "only",
                         "--maximize seq_len finds the longest tokenizer.max_seq_len that fits; plain --fit keeps "
                         "the config's samples per step and finds the fastest micro-batch")
    if "png" in options and Path(options["png"]).suffix.lower() != ".png":
        raise UsageError(f"--png {options['png']}: the chart is a PNG image: name the file with .png")
    for flag, key in (("--json", "json"), ("--png", "png")):
        if key in options:
            check_writable(Path(options[key]), flag, f"plan.{key}")
    if "json" in options and "png" not in options:
        check_writable(Path(options["json"]).with_suffix(".png"), "--png (beside --json)", "plan.png")
    if fit:
        check_writable(Path(options.get("output") or "mtune_fit.yaml"),
                       "--output" if "output" in options else "--output (default)", "mtune_fit.yaml")
