"""Check a whole config without running it: interpolations, components, keywords, schema, rules, paths."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtune.config.errors import ConfigError
from mtune.config.instantiate import value_problems, check_keywords, resolve_component
from mtune.config.loading import COMPONENT
from mtune.config.schema import RecipeSchema

TRUSTED_PACKAGES = ("mtune", "torch", "torchao", "bitsandbytes")
"""The packages whose components ``mtune validate`` does not list: anything else a config names runs as code too."""

# Keys that name inputs which should exist; written outputs (output_dir, log_dir) are left out.
_PATH_SUFFIXES = ("_dir", "path", "_file", "_files", "_path", "_paths")
_WRITTEN = {"output_dir", "log_dir"}


@dataclass
class ValidationReport:
    """``errors`` make the config unusable; ``warnings`` (paths that do not exist yet) may be intended;
    ``unchecked`` names the component arguments whose values cannot be type-checked (their parameter has no
    annotation); ``notes`` say what only the run itself can check."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # component arguments whose parameter has no annotation
    notes: list[str] = field(default_factory=list)  # what cannot be known before the run (printed by validate)
    foreign: list[str] = field(default_factory=list)  # "key: dotted.path" of components outside TRUSTED_PACKAGES

    @property
    def ok(self) -> bool:
        return not self.errors


def validate_config(cfg: DictConfig, schema: RecipeSchema | None = None, *, before_run: bool = False
                    ) -> ValidationReport:
    """Every problem with ``cfg``: unresolvable interpolations, unknown ``_component_`` paths, keywords a
    component does not accept, recipe-level keys against ``schema`` (when given) and its rules, plus warnings for
    input paths that do not exist.

    Required component arguments are not checked here, since recipes pass some in code (model parameters).
    ``before_run``: the check before ``mtune run`` starts the recipe, which checks the warmup itself against the
    run's exact length (so it is not said twice).
    """
    report = ValidationReport()
    for key, parent, name in _walk(cfg, ""):
        try:
            value = parent[name]
        except OmegaConfBaseException as err:
            report.errors.append(f"{key}: cannot resolve its value: {str(err).splitlines()[0]}")
            continue
        if isinstance(value, DictConfig) and COMPONENT in value:
            try:
                target = resolve_component(value[COMPONENT], key=f"{key}.{COMPONENT}")
            except ConfigError as err:
                report.errors.append(str(err))
            else:
                if str(value[COMPONENT]).split(".")[0] not in TRUSTED_PACKAGES:
                    report.foreign.append(f"{key}: {value[COMPONENT]}")
                report.errors += check_keywords(target, [k for k in value if k != COMPONENT], key)
                problems, unchecked = value_problems(target, _resolvable(value), key)
                report.errors += problems
                report.unchecked += unchecked
        if _looks_like_input_path(name) and value is not None:
            for path in value if isinstance(value, ListConfig) else [value]:
                if isinstance(path, str) and not os.path.exists(os.path.expanduser(path)):
                    report.warnings.append(f"{key}: path does not exist: {path}")
    if schema is not None:
        report.errors += [p for p in schema.check(cfg) if p not in report.errors]
        if not report.errors and not before_run:
            _check_warmup(cfg, report)
    return report


def warmup_problem(warmup: Any, total_steps: int, how: str) -> str | None:
    """The error when ``lr_scheduler.num_warmup_steps`` leaves no step at the full learning rate: ``warmup`` is at
    least the run's ``total_steps`` (``how`` says where that total comes from)."""
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < total_steps:
        return None
    return (f"lr_scheduler.num_warmup_steps={warmup} is not shorter than the run ({how}: {total_steps} steps): the "
            "learning rate would never reach optimizer.lr; lower num_warmup_steps (a few percent of the steps is "
            "usual) or train longer")


def _check_warmup(cfg: DictConfig, report: ValidationReport) -> None:
    """Warmup against the run's length where the config alone bounds it (``max_steps_per_epoch`` x ``epochs``);
    otherwise a note that only the run can tell (the steps per epoch depend on the dataset)."""
    try:
        warmup = OmegaConf.select(cfg, "lr_scheduler.num_warmup_steps", default=None)
        per_epoch, epochs = cfg.get("max_steps_per_epoch"), cfg.get("epochs") or 1
    except OmegaConfBaseException:
        return
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup == 0 or not isinstance(epochs, int):
        return
    if isinstance(per_epoch, int):
        problem = warmup_problem(warmup, per_epoch * epochs, f"at most max_steps_per_epoch x epochs = {per_epoch} x "
                                 f"{epochs}")
        if problem:  # max_steps_per_epoch cuts the run short on purpose (a smoke run): `mtune run` warns then
            report.warnings.append(problem + " (max_steps_per_epoch cuts the run short: it would run all in warmup)")
        return
    report.notes.append(f"lr_scheduler.num_warmup_steps={warmup}: the run's total steps are known only once the "
                        "dataset is read, so `mtune run` checks the warmup against them before the first step")


def _resolvable(node: DictConfig) -> dict[str, Any]:
    """The plain values of ``node``'s keys that resolve (those that do not are reported on their own)."""
    values = {}
    for name in node:
        if name == COMPONENT:
            continue
        try:
            values[name] = node[name]
        except OmegaConfBaseException:
            continue
    return values


def _walk(node: DictConfig | ListConfig, prefix: str) -> Iterator[tuple[str, Any, Any]]:
    """``(dotted key, parent, name)`` for every entry, depth first, without resolving interpolations twice."""
    names = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for name in names:
        if name == COMPONENT:
            continue
        if isinstance(node, DictConfig):
            key = f"{prefix}.{name}" if prefix else str(name)
        else:
            key = f"{prefix}[{name}]"
        yield key, node, name
        child = node._get_node(name)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            yield from _walk(child, key)


def _looks_like_input_path(name: Any) -> bool:
    return isinstance(name, str) and name not in _WRITTEN and name.endswith(_PATH_SUFFIXES)
