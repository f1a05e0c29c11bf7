"""``mtune plan``: predict the peak memory of a training config before a GPU is touched (and, with ``--fit``, find
the fastest config that fits). Light at import: torch loads only when a plan runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
from mtune._cli.errors import UsageError
from mtune._cli.plan_options import (
    check_options, parse_plan_args, refuse_a_budget_within_the_margin, refuse_a_recipe_that_trains_nothing,
    write_or_refuse,
)
from mtune._cli.run import load_and_check, parse_run_args

USAGE = """\
usage: mtune plan [--device-memory SIZE] [--host-memory SIZE]
                  [--fit [--maximize seq_len] [--lossless-only | --allow-lossy] [--output FILE]]
                  [--from-data] [--json FILE] [--png FILE]
                  [--nproc_per_node N] RECIPE --config CONFIG [key=value ...]

Predict the peak memory of RECIPE with CONFIG (after the overrides) without running it: the recipe's own setup
code builds the model, adapters, NF4 weights, optimizer and memory techniques on fake tensors and runs two
training steps; no weight file is read and no real memory is used. The target is the config's `device`
(device=cuda is accepted on a machine without a GPU).

options:
  --device-memory SIZE   the device's memory (24GiB, 80GB, ...): say whether the plan fits and by how much
  --host-memory SIZE     the host memory offloaded tensors may use (--fit: default this machine's total less a
                         reserve of max(4 GiB, 10%); needed when the config's GPU is not on this machine)
  --fit                  search the memory flags for the fastest config that fits --device-memory (less an
                         allocator margin of max(1 GiB, 5%)) and the host: lossless first (the same numbers),
                         lossy ones only when nothing lossless fits; write it as a ready-to-run YAML (--output,
                         default ./mtune_fit.yaml). docs/plan.md: the cost model and the order
  --maximize seq_len     --fit: the longest tokenizer.max_seq_len that fits instead (packed rows, one row per
                         micro-batch), with the fastest techniques that fit it; prints the curve (context ->
                         planned peak) and what limits it; stops at the model's trained context
  --lossless-only        --fit: refuse rather than give up numerics (8-bit states, fp8/NF4 bases, clipping)
  --allow-lossy          --fit: lossy choices compete on speed with the lossless ones
  --output FILE          where --fit writes the best config
  --from-data            read the config's dataset (tokenized as a run would), print its row lengths (min, median,
                         p95, max) and plan the longest batch it makes instead of rows of tokenizer.max_seq_len
  --json FILE            also write the plan as JSON (device_peak_bytes, host_peak_bytes, device/host categories)
  --png FILE             draw the plan as a stacked bar chart, a .png file (default: beside --json, with .png)
  --nproc_per_node N     plan each rank of an N-process distributed run (FSDP2)

Exit status: 1 when the plan does not fit --device-memory or --host-memory (or --fit finds nothing), 2 for a bad
command line.
"""

# Hugging Face repo names of the families' checkpoints -> (family, size); sizes must be in the family's table.
_REPO_NAMES = [
    (re.compile(r"Qwen3\.5-(\d+)B-A(\d+)B", re.IGNORECASE), "qwen3_5", "{}B_A{}B"),
    (re.compile(r"Qwen3\.5-(\d+(?:\.\d+)?)B", re.IGNORECASE), "qwen3_5", "{}B"),
    (re.compile(r"Qwen3-(\d+)B-A(\d+)B", re.IGNORECASE), "qwen3_moe", "{}B_A{}B"),
    (re.compile(r"gemma-4-(\d+)B-A(\d+)B", re.IGNORECASE), "gemma4", "{}B_A{}B"),
    (re.compile(r"gemma-4-(E?\d+)B", re.IGNORECASE), "gemma4", "{}B"),
    (re.compile(r"gpt-oss-(\d+)b", re.IGNORECASE), "gpt_oss", "{}B"),
    (re.compile(r"Llama-2-(\d+)b", re.IGNORECASE), "llama2", "{}B"),
    (re.compile(r"Llama-3\.1-(\d+)B", re.IGNORECASE), "llama3_1", "{}B"),
    (re.compile(r"Llama-3\.2-(\d+)B", re.IGNORECASE), "llama3_2", "{}B"),
    (re.compile(r"Qwen2\.5-(\d+(?:\.\d+)?)B", re.IGNORECASE), "qwen2_5", "{}B"),
    (re.compile(r"Mistral-(\d+)B.*v0\.3", re.IGNORECASE), "mistral", "{}B-v0.3"),
    (re.compile(r"Mistral-(\d+)B", re.IGNORECASE), "mistral", "{}B"),
]


def named_size(text: str) -> tuple[str, str] | None:
    """``(family, size)`` of a model named like its Hugging Face repo (``meta-llama/Llama-3.2-1B-Instruct`` ->
    ``("llama3_2", "1B")``), or None."""
    for pattern, family, size in _REPO_NAMES:
        match = pattern.search(text)
        if match:
            return family, size.format(*match.groups())
    return None


def plan_without_download(cfg, config_path: Path) -> str | None:
    """Planning needs no weights: when ``model.checkpoint_dir`` has no ``config.json`` yet (not downloaded), plan
    the model from its family and size instead, taken from ``model.family`` + ``model.size`` when the command line
    gives them, else from the directory's name, else from the repo id of the ``mtune download`` line in the
    config's header. Rewrites ``cfg.model`` accordingly and returns the line that says which, or None when the
    checkpoint is there (or nothing names a size: then the planner's own error stands)."""
    from mtune.models import FAMILIES

    model = cfg.get("model")
    checkpoint_dir = model.get("checkpoint_dir") if hasattr(model, "get") else None
    if not checkpoint_dir or (Path(checkpoint_dir) / "config.json").is_file():
        return None
    found, how = None, ""
    if model.get("family") and model.get("size"):
        found, how = (str(model.family), str(model.size)), "model.family and model.size"
    if found is None:
        found, how = named_size(Path(checkpoint_dir).name), "the name of model.checkpoint_dir"
    if found is None:
        header = re.search(r"^#.*mtune download (\S+)", config_path.read_text(encoding="utf-8"), re.MULTILINE)
        if header:
            found, how = named_size(header.group(1)), f"the repo id {header.group(1)} in the config's header"
    if found is None or found[0] not in FAMILIES or found[1] not in FAMILIES[found[0]][1]:
        return None
    model.checkpoint_dir, model.family, model.size = None, found[0], found[1]
    return (f"{checkpoint_dir} has no config.json yet (not downloaded): planning {found[0]} {found[1]} from its "
            f"named size, read from {how}; set model.family=... model.size=... to plan another")


def refuse_a_host_not_here(cfg) -> None:
    """``--fit`` for a GPU that is not on this machine (a CUDA target, no GPU here) without ``--host-memory``: the
    host budget would be this machine's, which is not the GPU's host, so the command asks for it instead of
    answering for the wrong machine (docs/plan.md, "Budgets")."""
    import torch

    from mtune.training.planning.cost import is_cuda_target
    from mtune.training.planning.fit import default_host_memory
    from mtune.units import format_bytes

    if is_cuda_target(cfg) and not torch.cuda.is_available():
        here, _ = default_host_memory()
        raise UsageError(f"--fit for device={cfg.device}, which is not on this machine (no GPU here): give "
                         "--host-memory SIZE, the memory of the machine that holds the GPU (this machine's budget "
                         f"would be {format_bytes(here)}: its total less a reserve of max(4 GiB, 10%))")


def plan_command(argv: list[str]) -> int:
    options, rest = parse_plan_args(argv)
    if options.get("help") or not rest:
        print(USAGE, end="")
        return 0 if options.get("help") else 2
    args = parse_run_args(rest)
    if args.launcher:
        raise UsageError("launcher options go before RECIPE in `mtune plan` too; only --nproc_per_node is read")
    if args.help:
        print(USAGE, end="")
        return 0
    world_size = options.get("nproc_per_node") or "1"
    if not (world_size.isdigit() and int(world_size) > 0):
        raise UsageError(f"--nproc_per_node {world_size}: expected a positive number of ranks to plan for")
    world_size = int(world_size)
    check_options(options)

    from mtune.units import parse_budget

    device_memory = parse_budget(options["device_memory"], "--device-memory") if "device_memory" in options else None
    host_memory = parse_budget(options["host_memory"], "--host-memory") if "host_memory" in options else None
    if options["fit"]:
        refuse_a_budget_within_the_margin(device_memory, f"--device-memory={options['device_memory']}")

    recipe_path = find_recipe(args.recipe)
    module = load_recipe_module(recipe_path)
    refuse_a_recipe_that_trains_nothing(module, args.recipe, "mtune plan --fit" if options["fit"] else "mtune plan",
                                        "`mtune ls` lists the recipes; plan a training one such as "
                                        "lora_single_device or full_single_device")
    if args.config is None:
        raise UsageError("missing --config", f"mtune plan {args.recipe} --config CONFIG")
    config_path = find_config(args.config)
    cfg = load_and_check(module, config_path, args.overrides, recipe_path.stem)
    planned_from = plan_without_download(cfg, config_path)
    if planned_from:
        print(f"mtune plan: {planned_from}", file=sys.stderr)

    from mtune.training.planning.plan import plan_memory

    if options["fit"] and host_memory is None:
        refuse_a_host_not_here(cfg)
    lossy = "never" if options.get("lossless_only") else "compete" if options.get("allow_lossy") else "fallback"
    if options["fit"] and "maximize" in options:
        from mtune.training.planning.longest import longest_command

        return longest_command(cfg, recipe=args.recipe, config_path=config_path, overrides=args.overrides,
                               schema=module.SCHEMA, maximize=options["maximize"], device_memory=device_memory,
                               host_memory=host_memory, world_size=world_size,
                               output=Path(options.get("output") or "mtune_fit.yaml"), lossy=lossy)
    if options["fit"]:
        from mtune.training.planning.fit import fit_command

        return fit_command(cfg, recipe=args.recipe, config_path=config_path, overrides=args.overrides,
                           schema=module.SCHEMA, device_memory=device_memory, host_memory=host_memory, world_size=world_size,
                           output=Path(options.get("output") or "mtune_fit.yaml"), lossy=lossy)
    seq_len = None
    if options.get("from_data"):
        from mtune.training.planning.data_lengths import data_lengths

        lengths = data_lengths(cfg)
        print(lengths.line())
        seq_len = lengths.longest_batch
    plan = plan_memory(cfg, device_memory=device_memory, host_memory=host_memory, world_size=world_size,
                       seq_len=seq_len)
    print(f"mtune plan: {args.recipe} with {config_path} ({plan.seconds:.1f} s)")
    print(plan.table())
    if "json" in options:
        write_or_refuse(Path(options["json"]), "--json",
                        lambda path: path.write_text(json.dumps(plan.to_json(), indent=2) + "\n"))
        print(f"json: {options['json']}")
    png = options.get("png") or (str(Path(options["json"]).with_suffix(".png")) if "json" in options else None)
    if png:
        written = write_or_refuse(Path(png), "--png", plan.plot)
        if written is not None:
            print(f"chart: {written}")
    # Exit 1 when the plan does not fit a budget that was given, the device's or the host's (docs/plan.md).
    return 1 if any(spare is not None and spare < 0 for spare in plan.fits().values()) else 0
