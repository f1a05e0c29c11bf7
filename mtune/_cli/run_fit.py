"""``mtune run --fit``: plan at launch with ``mtune plan --fit``'s search
(`mtune.training.planning.fit.fit_command`), against ``--device-memory``, else the config's
``device_memory_limit``, else the CUDA device's free memory; write the chosen config into the output directory
and hand it to the run."""

from __future__ import annotations

import sys
from pathlib import Path

from mtune._cli.errors import CliError, UsageError
from mtune._cli.plan_options import (
    check_writable, refuse_a_budget_within_the_margin, refuse_a_recipe_that_trains_nothing,
)
from mtune._cli.run import load_and_check

__all__ = ["fit_at_launch", "FIT_CONFIG_NAME"]

FIT_CONFIG_NAME = "mtune_fit.yaml"
"""The chosen config, in ``output_dir``: the one the run runs (and a resume reads again with ``--config``)."""


def fit_at_launch(module, recipe: str, config_path: Path, overrides: list[str], budgets: dict[str, str]) -> Path | None:
    """Plan ``recipe`` with ``config_path`` and ``overrides`` for the fastest config that fits, print the answer
    (what changed and why: the planner's lines), write it to ``output_dir/mtune_fit.yaml`` and return its path;
    None when nothing fits (the planner printed why). ``--device-memory`` also becomes the run's
    ``device_memory_limit``, so the run is held to the budget it was planned for. A recipe that trains nothing,
    and a budget that the allocator's margin leaves nothing of, are refused before the config is planned."""
    from mtune.units import parse_budget

    refuse_a_recipe_that_trains_nothing(module, recipe, "mtune run --fit",
                                        f"run it without --fit: mtune run {recipe} --config {config_path}")
    device_memory = parse_budget(budgets["--device-memory"], "--device-memory") if "--device-memory" in budgets \
        else None
    host_memory = parse_budget(budgets["--host-memory"], "--host-memory") if "--host-memory" in budgets else None
    if device_memory is not None:
        refuse_a_budget_within_the_margin(device_memory, f"--device-memory={budgets['--device-memory']}")
        overrides = [*overrides, f"device_memory_limit={budgets['--device-memory']}"]
    cfg = load_and_check(module, config_path, overrides, recipe)
    if device_memory is None:
        device_memory, source = _device_budget(cfg)
        refuse_a_budget_within_the_margin(device_memory, source, CliError)
        print(f"mtune run --fit: planning for {source}", file=sys.stderr)
    output_dir = Path(cfg.output_dir)
    _refuse_a_run_there(cfg, output_dir)  # before writing into it: the run itself would refuse it after the search
    output = output_dir / FIT_CONFIG_NAME
    try:  # before the search, so that a search is not spent on an answer that cannot be written
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CliError(f"output_dir={output_dir}: cannot create it, where --fit writes {FIT_CONFIG_NAME}: "
                       f"{err.strerror or err}", "set output_dir to a directory you can write") from err
    check_writable(output, "--fit's config", FIT_CONFIG_NAME)

    from mtune.training.planning.fit import fit_command

    status = fit_command(cfg, recipe=recipe, config_path=config_path, overrides=overrides, schema=module.SCHEMA,
                         device_memory=device_memory, host_memory=host_memory, world_size=1, output=output)
    if status != 0:
        return None
    print(f"mtune run --fit: running {recipe} with {output} (the answer above: its changes to {config_path.name}, "
          "and why they fit)", file=sys.stderr)
    return output


def _device_budget(cfg) -> tuple[int, str]:
    """The device memory to plan for without ``--device-memory``: ``device_memory_limit``, else the free memory of
    the CUDA device the run would use; without either, a one-line refusal."""
    from mtune.units import format_bytes, parse_budget

    limit = cfg.get("device_memory_limit")
    if limit is not None:
        return parse_budget(limit, "device_memory_limit"), f"device_memory_limit={limit}"
    from mtune.training.context import resolve_device

    device = resolve_device(str(cfg.device))
    if device.type != "cuda":
        raise UsageError(f"--fit: the run's device is {device}, whose memory mtune cannot read as a GPU's: give "
                         "--device-memory SIZE (or set device_memory_limit=SIZE)")
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return free, f"{device}'s free memory, {format_bytes(free)} of {format_bytes(total)} (--device-memory to change)"


def _refuse_a_run_there(cfg, output_dir: Path) -> None:
    from mtune.training.context import claim_output_dir

    claim_output_dir(output_dir, resuming=bool(cfg.get("resume_from_checkpoint")),
                     overwrite=bool(cfg.get("overwrite_output_dir")), is_main=False)
