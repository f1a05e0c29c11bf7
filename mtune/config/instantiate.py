"""Build objects from config nodes that name a ``_component_`` by dotted path."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Callable

from omegaconf import DictConfig, ListConfig, OmegaConf

from mtune.config.errors import ComponentError, ConfigError, closest, did_you_mean
from mtune.errors import MtuneError
from mtune.config.loading import COMPONENT


def full_key(node: Any, default: str = "<config>") -> str:
    """The dotted key of an OmegaConf node inside its root config (``optimizer``, ``dataset.source``)."""
    try:
        key = node._get_full_key("")
    except Exception:
        return default
    return key or default


def resolve_component(path: str, key: str = "_component_") -> Callable:
    """Import the object named by the dotted ``path``; ``key`` names the config key in errors.

    An unknown path raises `ConfigError` naming the key and, when one exists, the closest importable name.
    """
    if not isinstance(path, str) or not path or path.startswith(".") or path.endswith("."):
        raise ConfigError(f"{key}: '{path}' is not a dotted path such as torch.optim.AdamW")
    parts = path.split(".")
    module, depth = None, 0
    for depth in range(len(parts), 0, -1):
        name = ".".join(parts[:depth])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            # A module that exists but fails on a missing import of its own is not a typo in the path.
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise
    if module is None:
        top = {m.name for m in pkgutil.iter_modules()}
        raise ConfigError(f"{key}: cannot import '{path}': no module named '{parts[0]}'{did_you_mean(parts[0], top)}")
    obj, done = module, ".".join(parts[:depth])
    for attr in parts[depth:]:
        if not hasattr(obj, attr):
            candidates = [n for n in dir(obj) if not n.startswith("_")]
            if inspect.ismodule(obj) and hasattr(obj, "__path__"):
                candidates += [m.name for m in pkgutil.iter_modules(obj.__path__)]
            match = closest(attr, candidates)
            hint = f" (did you mean '{done}.{match}'?)" if match else ""
            raise ConfigError(f"{key}: cannot import '{path}': '{done}' has no attribute '{attr}'{hint}")
        obj, done = getattr(obj, attr), f"{done}.{attr}"
    if not callable(obj):
        raise ConfigError(f"{key}: '{path}' is not callable, so it cannot be a _component_")
    return obj


def accepted_keywords(target: Callable) -> tuple[list[str], bool, list[str]]:
    """``(keyword names, takes **kwargs, required names)`` of ``target``'s signature.

    Targets whose signature cannot be read (some builtins) report ``takes **kwargs`` so nothing is refused.
    """
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return [], True, []
    names, required, var_kw = [], [], False
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            var_kw = True
        elif param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            names.append(param.name)
            if param.default is param.empty:
                required.append(param.name)
    return names, var_kw, required


def check_keywords(target: Callable, keywords, key: str) -> list[str]:
    """Problems (one line each) with passing ``keywords`` to ``target``; ``key`` names the node."""
    names, var_kw, _ = accepted_keywords(target)
    if var_kw:
        return []
    label = getattr(target, "__qualname__", repr(target))
    return [
        f"{key}.{kw}: {label} does not accept '{kw}'{did_you_mean(kw, names)}" for kw in keywords if kw not in names
    ]


_BOOL_ANNOTATIONS = {"bool": False, "bool|None": True, "None|bool": True, "Optional[bool]": True,
                     "typing.Optional[bool]": True}


def _bool_parameter(param: inspect.Parameter) -> bool | None:
    """Whether ``param`` takes a boolean: None when it does not, else whether it also takes None. Read from its
    annotation (a type or, under ``from __future__ import annotations``, its text); an unannotated parameter whose
    default is True or False is taken as boolean too."""
    annotation = param.annotation
    if annotation is param.empty:
        return False if isinstance(param.default, bool) else None
    if annotation is bool:
        return False
    if isinstance(annotation, str):
        return _BOOL_ANNOTATIONS.get(annotation.replace(" ", ""))
    args = set(getattr(annotation, "__args__", ()) or ())
    if args == {bool, type(None)}:  # Optional[bool], bool | None
        return True
    return None


_NUMBER_ANNOTATIONS = {spelling: (kind, takes_none) for kind in ("float", "int")
                       for spelling, takes_none in ((kind, False), (f"{kind}|None", True), (f"None|{kind}", True),
                                                    (f"Optional[{kind}]", True), (f"typing.Optional[{kind}]", True))}


def _number_parameter(param: inspect.Parameter) -> tuple[type, bool] | None:
    """``(float or int, whether it also takes None)`` for a parameter annotated ``float`` or ``int`` (optionally with
    None, as a type or as text); None for any other annotation."""
    annotation = param.annotation
    if isinstance(annotation, str):
        found = _NUMBER_ANNOTATIONS.get(annotation.replace(" ", ""))
        return None if found is None else ({"float": float, "int": int}[found[0]], found[1])
    if annotation in (float, int):
        return annotation, False
    args = set(getattr(annotation, "__args__", ()) or ())
    for kind in (float, int):
        if args == {kind, type(None)}:  # Optional[float], int | None
            return kind, True
    return None


def _value_problem(param: inspect.Parameter, value: Any) -> str | None:
    """What is wrong with ``value`` for a parameter annotated bool or a number (its text after "takes"), or None."""
    takes_bool, number = _bool_parameter(param), _number_parameter(param)
    if takes_bool is None and number is None:
        return None
    takes_none = takes_bool if takes_bool is not None else number[1]
    if value is None and (takes_none or param.default is None):
        return None
    if takes_bool is not None:
        return None if isinstance(value, bool) else "true or false"
    fits = isinstance(value, (int, float) if number[0] is float else int) and not isinstance(value, bool)
    return None if fits else ("a number" if number[0] is float else "an integer")


def value_problems(target: Callable, values: dict[str, Any], key: str) -> tuple[list[str], list[str]]:
    """``(problems, unchecked)`` for the keyword ``values`` a config passes to ``target``: a problem for each value
    given to a boolean parameter (see :func:`_bool_parameter`) that is not true or false (YAML's ``yes``/``no``/
    ``on``/``off`` spellings already load as booleans), or to a parameter annotated ``float`` / ``int`` that is not
    a number / an integer (``beta=abc`` would otherwise fail only once the run built it, after loading the data);
    and the dotted keys whose parameter has no annotation, so that nothing can be checked about them. Values still
    holding an interpolation are skipped."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return [], []
    label = getattr(target, "__name__", repr(target))
    problems, unchecked = [], []
    for name, value in values.items():
        param = params.get(name)
        if param is None:
            continue
        if param.annotation is param.empty and _bool_parameter(param) is None:
            unchecked.append(f"{key}.{name}")
            continue
        wanted = _value_problem(param, value)
        if wanted is not None:
            shown = f"{type(value).__name__} {value!r}" if value is not None else "null"
            problems.append(f"{key}.{name}: {label} takes {wanted}, got {shown}")
    return problems, unchecked


def instantiate(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Build the object a config node describes.

    ``node`` is a mapping with ``_component_`` (a dotted path such as ``torch.optim.AdamW``); its other keys are
    passed as keyword arguments, after building any nested ``_component_`` nodes (in dicts or lists) the same way.
    ``args`` go positionally to the top component (``instantiate(cfg.optimizer, model.parameters())``) and
    ``kwargs`` win over the node's keys. ``None`` gives ``None``, so optional nodes may be left out. Keys named in
    the target's ``__instantiate_raw__`` attribute are passed as plain dicts/lists, unbuilt.
    """
    if node is None:
        return None
    key = full_key(node)
    if isinstance(node, dict):
        node = OmegaConf.create(node)
    if not isinstance(node, DictConfig) or COMPONENT not in node:
        raise ConfigError(f"{key}: cannot instantiate a node without a '{COMPONENT}' key")
    target = resolve_component(node[COMPONENT], key=f"{key}.{COMPONENT}")
    # A target may take some keys as plain config (it builds them itself, e.g. with arguments known only then).
    raw = set(getattr(target, "__instantiate_raw__", ()))
    config_kwargs = {
        k: OmegaConf.to_container(node[k], resolve=True) if k in raw and _is_container(node[k]) else _build(node, k)
        for k in node
        if k != COMPONENT and k not in kwargs
    }
    merged = {**config_kwargs, **kwargs}
    problems = check_keywords(target, [k for k in config_kwargs], key)
    problems += value_problems(target, config_kwargs, key)[0]
    if problems:
        raise ConfigError(problems[0])
    names, var_kw, required = accepted_keywords(target)
    positional_filled = _positional_names(target)[: len(args)]
    missing = [n for n in required if n not in merged and n not in positional_filled]
    if missing:
        label = getattr(target, "__qualname__", repr(target))
        raise ConfigError(
            f"{key}: {label} is missing the required argument '{missing[0]}'",
            f"add {key}.{missing[0]}=... to the config or the command line",
        )
    return call_component(target, str(node[COMPONENT]), key, *args, **merged)


def call_component(target: Callable, label: str, key: str, /, *args: Any, **kwargs: Any) -> Any:
    """``target(*args, **kwargs)`` (``label``: its dotted path in the config); an exception raised inside it
    becomes one line naming the config key, the target and the error. mtune's own errors pass through (they are one line already), and so does running out of
    memory (the run's out-of-memory advice handles it)."""
    try:
        return target(*args, **kwargs)
    except MtuneError:
        raise
    except Exception as err:
        if type(err).__name__ == "OutOfMemoryError":
            raise
        detail = str(err).splitlines()[0] if str(err) else ""
        raise ComponentError(f"{key}: {label} raised {type(err).__name__}" + (f": {detail}" if detail
                             else ""), f"check {key} in the config; MTUNE_DEBUG=1 shows the traceback") from err


def _positional_names(target: Callable) -> list[str]:
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _is_container(value: Any) -> bool:
    return isinstance(value, (DictConfig, ListConfig))


def _build(parent: DictConfig | ListConfig, key: Any) -> Any:
    """The value of ``parent[key]`` as plain Python, with nested components built."""
    value = parent[key]  # reading resolves interpolations
    if isinstance(value, DictConfig):
        if COMPONENT in value:
            return instantiate(value)
        return {k: _build(value, k) for k in value}
    if isinstance(value, ListConfig):
        return [_build(value, i) for i in range(len(value))]
    return value
