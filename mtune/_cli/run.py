"""``mtune run``: check a config against a recipe's SCHEMA and call its ``main(cfg)``, or launch it with torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mtune._cli.catalog import find_config, find_recipe, is_training_recipe, load_recipe_module
from mtune._cli.errors import CliError, UsageError

USAGE = """\
usage: mtune run [--fit [--device-memory SIZE] [--host-memory SIZE]] [LAUNCHER OPTIONS] RECIPE --config CONFIG
                 [key=value ...] [~key ...]

Run RECIPE (a built-in name from `mtune ls`, or the path of your own recipe .py) with CONFIG (a built-in config
name such as llama3_2/1B_lora_single_device, or a YAML path), after applying the overrides.

planning at launch (before RECIPE):
  --fit                    plan first (`mtune plan --fit`): the fastest config that fits the device, written to
                           OUTPUT_DIR/mtune_fit.yaml, then run that config
  --device-memory SIZE     --fit: the device memory to fit (24GiB, ...); also the run's device_memory_limit. Default:
                           device_memory_limit, else the CUDA device's free memory (without a GPU: give one of them)
  --host-memory SIZE       --fit: the host memory offloaded tensors may use (default: this machine's available)

launcher options (before RECIPE; any of them runs the recipe under torchrun):
  --nproc_per_node N       processes (devices) per node
  --nnodes M               number of nodes
  --node_rank R            this node's rank
  --rdzv_endpoint HOST:PORT, --rdzv_backend, --rdzv_id, --master_addr, --master_port, --standalone, ...
                           any other option torch.distributed.run takes

after RECIPE:
  --config CONFIG          the config (required)
  key=value, a.b=value     override a key (value in YAML syntax: 3, true, null, [a,b], {k: v})
  node=dotted.Path         replace the _component_ of a node that has one
  ~key                     delete a key
  --help                   list the recipe's keys with their types, defaults and help
"""

# torchrun options that take no value; every other launcher option takes one.
_LAUNCHER_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module", "-m"}


# `mtune run --fit`'s budgets (before RECIPE, like the launcher options).
_FIT_BUDGETS = ("--device-memory", "--host-memory")

# Options that say where the rendezvous is; without any of them mtune adds --standalone.
_MULTI_NODE = {"--nnodes", "--rdzv_endpoint", "--rdzv-endpoint", "--rdzv_backend", "--rdzv-backend", "--master_addr",
               "--master-addr", "--master_port", "--master-port", "--standalone"}


@dataclass
class RunArgs:
    launcher: list[str] = field(default_factory=list)
    recipe: str | None = None
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    help: bool = False
    fit: bool = False  # --fit: plan at launch (mtune._cli.run_fit)
    fit_budgets: dict[str, str] = field(default_factory=dict)  # --device-memory / --host-memory, as given


def _check_nproc_per_node(launcher: list[str]) -> None:
    """torchrun takes a positive count or one of its device words; say so before it prints a traceback."""
    for k, opt in enumerate(launcher):
        name, eq, value = opt.partition("=")
        if name != "--nproc_per_node":
            continue
        value = value if eq else launcher[k + 1]
        if not (value.isdigit() and int(value) > 0) and value not in ("auto", "cpu", "gpu", "xpu"):
            raise UsageError(f"--nproc_per_node {value}: expected a positive number of processes (or auto, cpu, gpu)")


def parse_run_args(argv: list[str]) -> RunArgs:
    """Split ``argv`` into launcher options, RECIPE, ``--config`` and overrides; refuse anything else."""
    args, i = RunArgs(), 0
    while i < len(argv) and argv[i].startswith("-"):
        opt = argv[i]
        if opt in ("-h", "--help"):
            args.help = True
            return args
        if opt in ("--config", "-c") or opt.startswith("--config="):
            raise UsageError("RECIPE must come before --config", "mtune run RECIPE --config CONFIG [key=value ...]")
        name, eq, value = opt.partition("=")
        if name == "--fit" and not eq:
            args.fit, i = True, i + 1
            continue
        if name in _FIT_BUDGETS:
            if not eq and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
                raise UsageError(f"{name} needs a value, e.g. {name} 24GiB"
                                 + (f", not the option {argv[i + 1]}" if i + 1 < len(argv) else ""))
            args.fit_budgets[name] = value if eq else argv[i + 1]
            i += 1 if eq else 2
            continue
        if opt in _LAUNCHER_FLAGS - {"--standalone"}:
            raise UsageError(f"launcher option {opt} is not supported: mtune chooses how each rank starts")
        args.launcher.append(opt)
        if "=" not in opt and opt not in _LAUNCHER_FLAGS:
            if i + 1 >= len(argv):
                raise UsageError(f"launcher option {opt} needs a value")
            args.launcher.append(argv[i + 1])
            i += 1
        i += 1
    _check_nproc_per_node(args.launcher)
    if args.fit_budgets and not args.fit:
        raise UsageError(f"{next(iter(args.fit_budgets))} sets what --fit plans for: add --fit before it")
    if i >= len(argv):
        raise UsageError("missing RECIPE", "mtune run RECIPE --config CONFIG [key=value ...]; `mtune ls` lists recipes")
    args.recipe = argv[i]
    rest = argv[i + 1 :]
    j = 0
    while j < len(rest):
        token = rest[j]
        if token in ("-h", "--help"):
            args.help = True
        elif token in ("--config", "-c") or token.startswith("--config="):
            if "=" not in token and j + 1 >= len(rest):
                raise UsageError("--config needs a value")
            config = token.split("=", 1)[1] if "=" in token else rest[j + 1]
            if args.config is not None:
                raise UsageError(f"--config given twice ({args.config}, {config})",
                                 "give one config; change its keys with key=value overrides after it")
            args.config = config
            j += "=" not in token
        elif token.startswith("-"):
            name = token.lstrip("-").split("=", 1)[0]
            if name.startswith(("nproc", "nnodes", "node_rank", "rdzv", "master", "standalone")):
                hint = f"launcher options go before RECIPE: mtune run {token} ... RECIPE --config ..."
            else:
                hint = f"after RECIPE, write config overrides as key=value, e.g. {name}=VALUE"
            raise UsageError(f"unexpected option '{token}' after the recipe", hint)
        elif "=" in token or token.startswith("~"):
            args.overrides.append(token)
        else:
            raise UsageError(f"unexpected argument '{token}'", "overrides are key=value or ~key")
        j += 1
    return args


def run_command(argv: list[str]) -> int:
    args = parse_run_args(argv)
    if args.help and args.recipe is None:
        print(USAGE, end="")
        return 0
    recipe_path = find_recipe(args.recipe)
    if args.help:
        return _print_recipe_help(recipe_path)
    if args.config is None:
        raise UsageError("missing --config", f"mtune run {args.recipe} --config CONFIG; `mtune ls` lists configs")
    config_path = find_config(args.config)
    overrides = args.overrides
    if args.fit:
        if args.launcher:
            raise UsageError("--fit plans one device: drop the launcher options, or plan the distributed run with "
                             "`mtune plan --fit --nproc_per_node N` and run the config it writes")
        from mtune._cli.run_fit import fit_at_launch

        config_path = fit_at_launch(load_recipe_module(recipe_path), recipe_path.stem, config_path, overrides,
                                    args.fit_budgets)
        if config_path is None:
            return 1  # nothing fits: the planner said why
        overrides = []  # written into the chosen config
    if not args.launcher:
        run_recipe(recipe_path, config_path, overrides)
        return 0
    module = load_recipe_module(recipe_path)
    if not getattr(module, "SUPPORTS_DISTRIBUTED", False):
        raise CliError(
            f"recipe '{args.recipe}' does not support distributed runs",
            "drop the launcher options, or pick a *_distributed recipe (see `mtune ls`)",
        )
    cfg = load_and_check(module, config_path, args.overrides, recipe_path.stem)  # fail here once, not on every rank
    launcher = list(args.launcher)
    if not any(opt.split("=")[0] in _MULTI_NODE for opt in launcher if opt.startswith("-")):
        launcher.insert(0, "--standalone")  # one node: torchrun picks a free port, so parallel runs do not clash
    from mtune._cli.rank_failures import FAILURES_DIR_VARIABLE, summary

    with tempfile.TemporaryDirectory(prefix="mtune_ranks_") as failures:  # torchrun's agent, recording failed ranks
        command = [sys.executable, "-m", "mtune._cli.rank_failures", failures, *launcher, "--module",
                   "mtune._cli.launch_recipe", str(recipe_path), "--config", str(config_path), *args.overrides]
        code = subprocess.call(command, env={**os.environ, FAILURES_DIR_VARIABLE: failures})
        lines = summary(Path(failures), output_dir=cfg.get("output_dir"), command=["mtune", "run", *argv]) \
            if code else None
    print("\n".join(lines or []), file=sys.stderr, end="\n" if lines else "")
    return code


def _print_recipe_help(recipe_path: Path) -> int:
    from mtune.config import render_help

    module = load_recipe_module(recipe_path)
    doc = (module.__doc__ or "").strip()
    print(f"recipe {recipe_path.stem}" + (f": {doc.splitlines()[0]}" if doc else ""))
    print("distributed: " + ("yes (use --nproc_per_node N)" if getattr(module, "SUPPORTS_DISTRIBUTED", False) else "no"))
    print("\nconfig keys:\n")
    print(render_help(module.SCHEMA), end="")
    return 0


def load_and_check(module, config_path: Path, overrides: list[str], recipe: str | None = None):
    """The config with the overrides applied, checked against the recipe's SCHEMA (errors raised as one
    ConfigError; warnings printed) and its defaults filled in. A config whose ``recipe:`` names another recipe than
    ``recipe`` is refused first, by that name, when it does not fit this recipe's keys (a warning when it does)."""
    from mtune.config import ConfigError, load_config, validate_config

    cfg = load_config(config_path, overrides, module.SCHEMA.text_keys)
    report = validate_config(cfg, module.SCHEMA, before_run=True)  # the run checks its warmup itself, once
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    named = cfg.get("recipe")
    if recipe is not None and named is not None and str(named) != recipe:
        if report.errors:
            raise ConfigError(
                f"{config_path} is a config for the recipe {named}, not {recipe} ({len(report.errors)} of its keys do "
                f"not fit {recipe}, e.g. {report.errors[0]})",
                f"mtune run {named} --config {config_path}; or `mtune ls` for {recipe}'s configs")
        print(f"warning: {config_path} says recipe: {named}; running it with {recipe}", file=sys.stderr)
    if report.errors:
        for problem in report.errors[:-1]:
            print(f"error: {problem}", file=sys.stderr)
        raise ConfigError(report.errors[-1], f"fix the config or override the key; `mtune validate {config_path}`")
    module.SCHEMA.fill_defaults(cfg)
    return cfg


def run_recipe(recipe_path: Path, config_path: Path, overrides: list[str]) -> None:
    """Load the recipe and config, check the config against the recipe's SCHEMA, then call ``main(cfg)``."""
    module = load_recipe_module(recipe_path)
    cfg = load_and_check(module, config_path, overrides, recipe_path.stem)
    if os.environ.get("RANK", "0") == "0" and os.environ.get("MTUNE_QUIET") != "1":
        print(f"mtune: running {recipe_path.stem} with {config_path}", file=sys.stderr)
    if is_training_recipe(module):
        from mtune.training.memory.oom import set_invocation

        set_invocation(recipe_path.stem, str(config_path), overrides)
    try:
        module.main(cfg)
    finally:
        if "mtune.training.output_lock" in sys.modules:  # a training recipe locked its output_dir
            sys.modules["mtune.training.output_lock"].release_output_locks()
