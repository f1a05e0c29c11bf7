"""The package's shape, checked on its source: modules talk through public names, and checkpoint I/O does not
reach up into the run machinery. Read with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import mtune

PACKAGE = Path(mtune.__file__).parent


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), filename=str(path))
    return modules


def _imports(tree: ast.AST):
    """``(imported module, imported name or None, line)`` for every import, function-local ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name, node.lineno


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(module: str) -> str:
    return module.rpartition(".")[0]


def _private_part(module: str) -> tuple[str, str] | None:
    """``(parent, private)`` for the outermost ``_``-named part of a dotted module name: ``("mtune",
    "mtune._cli")`` for ``mtune._cli.run``; None for a public module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            return ".".join(parts[:i]), ".".join(parts[: i + 1])
    return None


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_module_imports_a_private_name_of_another():
    # A private module (checkpointing/_shard_writer.py, the _cli package) is imported only from its parent package;
    # a name starting with one underscore stays in its module, or inside its private package (mtune._cli).
    problems = []
    for name, tree in _modules().items():
        for source, imported, line in _imports(tree):
            if not source.startswith("mtune.") or source == name:
                continue
            private = _private_part(source)
            if private is not None and not _within(name, private[0]):
                problems.append(f"{name}:{line} imports the private module {source}")
            if imported is not None and _is_private(imported) and not (private and _within(name, private[1])):
                problems.append(f"{name}:{line} imports {imported} from {source}")
    assert not problems, "\n".join(problems)


def test_checkpointing_does_not_import_the_run_machinery():
    forbidden = ("mtune.training.session", "mtune.training.distributed", "recipes")
    problems = [
        f"{name}:{line} imports {source}"
        for name, tree in _modules().items() if name.startswith("mtune.training.checkpointing")
        for source, _, line in _imports(tree)
        if any(source == f or source.startswith(f + ".") for f in forbidden)
    ]
    assert not problems, "\n".join(problems)


def test_light_packages_never_import_torch():
    # mtune.config and the CLI's light commands must start fast: no torch at module level or inside functions.
    problems = [
        f"{name}:{line} imports {source}"
        for name, tree in _modules().items() if name.startswith("mtune.config")
        for source, _, line in _imports(tree)
        if source == "torch" or source.startswith("torch.")
    ]
    assert not problems, "\n".join(problems)


def test_training_and_modules_import_mtune_at_module_level():
    # A function-local import of another mtune module would hide an import cycle; only the CLI (start-up time)
    # and the tokenizer loader (one family's library at a time) import lazily.
    problems = []
    for name, tree in _modules().items():
        if not name.startswith(("mtune.training", "mtune.modules", "mtune.models")):
            continue
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems += [f"{name}:{line} imports {source} inside {function.name}()"
                             for source, _, line in _imports(function) if source.startswith("mtune")]
    assert not problems, "\n".join(problems)
