"""Declarations of recipe-level config keys, checked by `mtune run` / `mtune validate` and rendered as docs.

A `Key` is one top-level setting; a `Node` is a mapping (``optimizer``, ``lora``) whose inner keys are checked by
signature when it has ``_component_``, or by its own `KeyGroup`. Groups are declared once (in
``mtune/config/keys.py``) and composed by each recipe into its `RecipeSchema`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtune.config.errors import did_you_mean
from mtune.config.loading import COMPONENT

Rule = Callable[[DictConfig], "list[str]"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default of a key that the config must set."""

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict", type(None): "None"}


@dataclass(frozen=True)
class Key:
    """One recipe-level key: ``type`` is a type or tuple of types among bool, int, float, str, list, dict.

    ``None`` is accepted when the default is None. ``choices`` limits the value to a fixed set.
    """

    name: str
    type: type | tuple[type, ...]
    default: Any = REQUIRED
    help: str = ""
    choices: tuple | None = None
    at_least: float | None = None  # value >= at_least
    above: float | None = None  # value > above
    at_most: float | None = None  # value <= at_most
    below: float | None = None  # value < below
    pattern: str | None = None  # a str value must match this regular expression in full

    @property
    def types(self) -> tuple[type, ...]:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        return types + ((type(None),) if self.default is None and type(None) not in types else ())

    @property
    def type_name(self) -> str:
        if self.choices:
            names = "|".join(str(c) for c in self.choices)
            return names + ("|None" if self.default is None else "")
        return " | ".join(_TYPE_NAMES.get(t, t.__name__) for t in self.types)

    @property
    def range_text(self) -> str:
        """The declared bounds in words, e.g. ``>= 0 and < 1`` (empty without bounds)."""
        parts = [f"{op} {_number(bound)}" for op, bound in
                 ((">=", self.at_least), (">", self.above), ("<=", self.at_most), ("<", self.below))
                 if bound is not None]
        return " and ".join(parts)

    def check(self, value: Any, key: str) -> list[str]:
        if not any(_is_instance(value, t) for t in self.types):
            return [f"{key}: expected {self.type_name}, got {_describe(value)}"]
        if value is None:
            return []
        if self.choices and value not in self.choices:
            return [f"{key}: must be one of {', '.join(map(str, self.choices))}, got {value!r}"]
        if self.pattern is not None and isinstance(value, str) and not re.fullmatch(self.pattern, value):
            return [f"{key}: {value!r} is not valid ({self.help})"]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and self.range_text and not (
            (self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
            and (self.at_most is None or value <= self.at_most) and (self.below is None or value < self.below)
        ):
            return [f"{key}: must be {self.range_text}{' (or null)' if self.default is None else ''}, got {value!r}"]
        return []


@dataclass(frozen=True)
class Node:
    """A mapping-valued key such as ``optimizer``; ``keys`` declares its inner keys when it has no component."""

    name: str
    help: str = ""
    keys: "KeyGroup | None" = None
    required: bool = False

    @property
    def default(self) -> Any:
        return REQUIRED if self.required else None

    @property
    def type_name(self) -> str:
        return "node" if self.keys is None else "mapping"


@dataclass(frozen=True)
class KeyGroup:
    """Keys that several recipes read, declared once. Checks across keys are rules of the `RecipeSchema`."""

    name: str
    keys: Sequence[Key | Node]
    help: str = ""

    def __post_init__(self) -> None:
        names = [k.name for k in self.keys]
        duplicates = {n for n in names if names.count(n) > 1}
        if duplicates:
            raise ValueError(f"KeyGroup {self.name} declares {sorted(duplicates)} more than once")

    def check(self, cfg: DictConfig, prefix: str = "") -> list[str]:
        """Problems with the keys of ``cfg`` against this group alone (unknown keys included)."""
        return _check_keys(cfg, {k.name: k for k in self.keys}, prefix)


@dataclass(frozen=True)
class RecipeSchema:
    """The recipe-level keys a recipe reads (its groups) and the rules across them (`cfg -> list[str]`, from
    `mtune.config.rules`)."""

    groups: Sequence[KeyGroup]
    rules: Sequence[Rule] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for group in self.groups:
            for key in group.keys:
                if key.name in seen:
                    raise ValueError(f"key {key.name!r} is declared by both {seen[key.name]} and {group.name}")
                seen[key.name] = group.name

    @property
    def keys(self) -> dict[str, Key | Node]:
        return {k.name: k for group in self.groups for k in group.keys}

    def check(self, cfg: DictConfig) -> list[str]:
        """Every problem with ``cfg``'s recipe-level keys: unknown or missing keys, wrong types, broken rules."""
        problems = _check_keys(cfg, self.keys, "")
        if problems:
            return problems  # rules read keys, so they run only on a well-formed config
        # Rules see the config as the recipe will: with every left-out key at its default.
        filled = self.fill_defaults(OmegaConf.create(OmegaConf.to_container(cfg, resolve=False)))
        for rule in self.rules:
            try:
                problems += list(rule(filled))
            except Exception as err:  # a rule must not hide the other problems
                problems.append(f"rule {getattr(rule, '__name__', rule)} failed: {type(err).__name__}: {err}")
        return problems

    @property
    def text_keys(self) -> set[str]:
        """Dotted names of the keys declared as plain text (type ``str`` alone): their overrides stay as written."""
        return {name for _, name, decl in _rows(self.groups) if isinstance(decl, Key) and decl.type is str}

    def fill_defaults(self, cfg: DictConfig) -> DictConfig:
        """Set every declared key that ``cfg`` leaves out to its default (nodes to None), in place."""
        _fill(cfg, self.keys)
        return cfg


def _check_keys(cfg: DictConfig, declared: dict[str, Key | Node], prefix: str) -> list[str]:
    problems = []
    for name in cfg:
        if name not in declared:
            problems.append(f"{prefix}{name}: unknown key{_suggest(name, declared, prefix)}")
    for name, decl in declared.items():
        key = f"{prefix}{name}"
        if name not in cfg:
            if decl.default is REQUIRED:
                problems.append(f"{key}: missing required key ({decl.help})" if decl.help else f"{key}: missing")
            continue
        try:
            value = cfg[name]
        except OmegaConfBaseException as err:
            problems.append(f"{key}: cannot resolve its value: {str(err).splitlines()[0]}")
            continue
        if isinstance(decl, Key):
            problems += decl.check(value, key)
        elif value is None:
            if decl.required:
                problems.append(f"{key}: must be set ({decl.help})")
        elif not isinstance(value, DictConfig):
            problems.append(f"{key}: expected a mapping of keys, got {_describe(value)}")
        elif decl.keys is not None and COMPONENT not in value:
            problems += _check_keys(value, {k.name: k for k in decl.keys.keys}, f"{key}.")
    return problems


def _suggest(name: str, declared: dict, prefix: str) -> str:
    hint = did_you_mean(name, declared)
    return hint.replace("'", f"'{prefix}", 1) if hint else ""


def _fill(cfg: DictConfig, declared: dict[str, Key | Node]) -> None:
    for name, decl in declared.items():
        if name not in cfg:
            if decl.default is not REQUIRED:
                cfg[name] = decl.default
        elif isinstance(decl, Node) and decl.keys is not None:
            value = cfg[name]
            if isinstance(value, DictConfig) and COMPONENT not in value:
                _fill(value, {k.name: k for k in decl.keys.keys})


def _is_instance(value: Any, t: type) -> bool:
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is list:
        return isinstance(value, (list, tuple, ListConfig))
    if t is dict:
        return isinstance(value, (dict, DictConfig))
    return isinstance(value, t)


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return f"{type(value).__name__} {value!r}"


def _default_text(decl: Key | Node) -> str:
    default = decl.default
    if default is REQUIRED:
        return "required"
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    return str(list(default)) if isinstance(default, (list, tuple)) else str(default)


def _rows(groups: Sequence[KeyGroup], prefix: str = ""):
    for group in groups:
        for decl in group.keys:
            yield group, f"{prefix}{decl.name}", decl
            if isinstance(decl, Node) and decl.keys is not None:
                for _, name, inner in _rows([decl.keys], f"{prefix}{decl.name}."):
                    yield group, name, inner


def render_markdown(schema: RecipeSchema) -> str:
    """The schema as a Markdown table (key, type, default, description), grouped by key group."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for _, name, decl in _rows(schema.groups):
        bounds = f" {decl.range_text}" if isinstance(decl, Key) and decl.range_text else ""
        type_name = (decl.type_name + bounds).replace("|", "\\|")  # a bare | would split the table cell
        lines.append(f"| `{name}` | {type_name} | `{_default_text(decl)}` | {decl.help} |")
    return "\n".join(lines) + "\n"


def render_help(schema: RecipeSchema) -> str:
    """The schema as plain text for ``mtune run RECIPE --help``: one line per key, grouped."""
    rows = list(_rows(schema.groups))
    width = max((len(name) for _, name, _ in rows), default=0) + 2
    lines, current = [], None
    for group, name, decl in rows:
        if group is not current:
            current = group
            lines.append(f"\n{group.name}" + (f": {group.help}" if group.help else ""))
        bounds = f" {decl.range_text}" if isinstance(decl, Key) and decl.range_text else ""
        meta = f"{decl.type_name}{bounds}, default {_default_text(decl)}"
        lines.append(f"  {name:<{width}}{decl.help} [{meta}]")
    return "\n".join(lines).lstrip("\n") + "\n"
