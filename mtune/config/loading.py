"""Load a YAML config and apply command-line overrides to it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Container, Sequence

import omegaconf
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtune.assets import asset_path
from mtune.config.errors import ConfigError, did_you_mean

COMPONENT = "_component_"

# `${mtune_asset:tiny/model}` in a config is the installed path of a file shipped with mtune (see mtune.assets).
# omegaconf 2.4 renamed register_new_resolver to register_resolver (2.3's register_resolver is the legacy one).
if not OmegaConf.has_resolver("mtune_asset"):
    _new_api = tuple(int(x) for x in omegaconf.__version__.split(".")[:2]) >= (2, 4)
    _register = OmegaConf.register_resolver if _new_api else OmegaConf.register_new_resolver
    _register("mtune_asset", lambda name: str(asset_path(name)))


def load_config(path: str | Path, overrides: Sequence[str] = (), text_keys: Container[str] = ()) -> DictConfig:
    """Read the YAML file at ``path`` and apply ``overrides`` (see `apply_overrides`; ``text_keys`` are the dotted
    keys declared as plain text, whose override values are kept as written).

    Interpolations such as ``${output_dir}/logs`` stay lazy: they resolve when a key is read.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}", "give a path to a YAML file or a built-in config name")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"{path}: {str(err).splitlines()[0]}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: a config must be a mapping of keys at the top level, found a list")
    apply_overrides(cfg, overrides, text_keys)
    return cfg


def parse_value(text: str):
    """A command-line value in YAML syntax: ``3`` -> 3, ``[a,b]`` -> ['a', 'b'], ``{k: v}`` -> {'k': 'v'},
    ``null`` -> None.

    Only text in brackets or braces becomes a list or mapping: ``Reverse the words: ink jar`` (YAML would read a
    mapping) and ``- x`` stay strings, as does text that is not valid YAML.
    """
    if text == "":
        return None
    try:
        value = _floats(yaml.safe_load(text))
    except yaml.YAMLError:
        return text
    if isinstance(value, (dict, list)) and not text.lstrip().startswith(("[", "{")):
        return text
    return value


# YAML 1.1 (PyYAML) reads 1e-4 as a string; omegaconf's file loader reads it as a float, and so do overrides.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _floats(value):
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    return value


def apply_overrides(cfg: DictConfig, overrides: Sequence[str], text_keys: Container[str] = ()) -> DictConfig:
    """Apply command-line overrides to ``cfg`` in place, in order, and return it.

    Forms: ``key=value`` and ``a.b.c=value`` (value in YAML syntax; missing parents are created), ``~a.b``
    (delete the key), and ``node=dotted.Path`` on a node that has ``_component_`` (replaces the component and
    keeps the node's other keys). A key in ``text_keys`` (declared as text by the recipe's schema) takes the value
    as written: ``prompt=123`` is the string ``"123"``; only ``null`` means None there.
    """
    for override in overrides:
        if override.startswith("~"):
            _delete(cfg, override[1:])
            continue
        key, sep, text = override.partition("=")
        if not sep or not key or key.startswith("-"):
            raise ConfigError(
                f"invalid override '{override}': expected key=value or ~key",
                "write overrides as key=value, e.g. batch_size=4",
            )
        value = None if key in text_keys and text in ("", "null", "~") else text if key in text_keys else (
            parse_value(text))
        current = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(current, DictConfig) and COMPONENT in current and isinstance(value, str):
            current[COMPONENT] = value
            continue
        try:
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"cannot apply override '{override}': {str(err).splitlines()[0]}") from None
    return cfg


def _delete(cfg: DictConfig, key: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig) and leaf in parent:
        del parent[leaf]
        return
    if isinstance(parent, ListConfig) and leaf.isdigit() and int(leaf) < len(parent):
        del parent[int(leaf)]
        return
    siblings = list(parent.keys()) if isinstance(parent, DictConfig) else []
    raise ConfigError(f"cannot delete '~{key}': the config has no key '{key}'{did_you_mean(leaf, siblings)}")
