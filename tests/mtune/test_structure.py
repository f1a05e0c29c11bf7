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


TECHNIQUES_PACKAGE = "mtune.training.memory.techniques"


def _is_declaration(module: str) -> bool:
    """A technique's declaration: the ``__init__`` of its package, ``techniques/<name>``."""
    return _package(module) == TECHNIQUES_PACKAGE


def test_training_and_modules_import_mtune_at_module_level():
    # A function-local import of another mtune module would hide an import cycle; only the CLI (start-up time),
    # the tokenizer loader (one family's library at a time) and a technique's declaration (its phases import the
    # implementation when they run, so that `mtune validate` reads the declaration without torch) import lazily.
    problems = []
    for name, tree in _modules().items():
        if not name.startswith(("mtune.training", "mtune.modules", "mtune.models")):
            continue
        if _is_declaration(name):
            continue
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems += [f"{name}:{line} imports {source} inside {function.name}()"
                             for source, _, line in _imports(function) if source.startswith("mtune")]
    assert not problems, "\n".join(problems)


# The packages from the bottom up: a module may import its own package and those below it, never one above
# (docs/architecture.md draws the same picture).
LAYERS = [
    ["mtune.errors", "mtune.assets", "mtune.units"],
    ["mtune.config"],
    ["mtune.tokenizers", "mtune.modules"],
    ["mtune.data", "mtune.models"],
    ["mtune.training.memory", "mtune.training.distributed", "mtune.training.rng", "mtune.training.signals",
     "mtune.training.lr_schedulers", "mtune.training.output_lock", "mtune.training.data_setup",
     "mtune.training.placement", "mtune.training.precision", "mtune.training.shards"],
    ["mtune.training.loop", "mtune.training.checkpointing", "mtune.training.task_eval", "mtune.training.optimizers",
     "mtune.training.run_length", "mtune.training.reference_cache"],
    ["mtune.training.observe", "mtune.training.context", "mtune.training.model_source", "mtune.training.model_setup"],
    ["mtune.training.planning", "mtune.training.measured_memory", "mtune.training.reference",
     "mtune.training.oom_recovery"],
    ["mtune.training.session"],
    ["mtune._cli", "mtune.__main__"],
]


def _layer(module: str) -> int | None:
    matches = [(len(package), i) for i, packages in enumerate(LAYERS) for package in packages
               if _within(module, package)]
    return max(matches)[1] if matches else None


def test_every_module_has_a_layer():
    assert [name for name in _modules() if name not in ("mtune", "mtune.training") and _layer(name) is None] == []


def test_no_import_runs_back_up():
    problems = []
    for name, tree in _modules().items():
        for source, _, line in _imports(tree):
            if source.startswith("mtune.") and _layer(source) is not None and _layer(name) is not None \
                    and _layer(source) > _layer(name):
                problems.append(f"{name}:{line} imports {source}, a package above it")
    assert not problems, "\n".join(problems)


def test_technique_declarations_never_import_torch():
    # `mtune validate` reads every technique's keys and rules: the declarations import no torch and no mtune module
    # that does, at module level (a phase imports the implementation beside it when it runs).
    declarations = [name for name in _modules() if _is_declaration(name)]
    contract = ("mtune.training.memory.technique", "mtune.training.memory.footprint")
    allowed = ("mtune.config", *contract, *declarations)
    problems = []
    for name, tree in _modules().items():
        if not (_is_declaration(name) or name in ("mtune.training.memory.registry", *contract)):
            continue
        for node in tree.body:  # module level only
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for source, _, line in _imports(node):
                if source == "torch" or source.startswith("torch.") or (
                        source.startswith("mtune") and not any(_within(source, a) for a in allowed)):
                    problems.append(f"{name}:{line} imports {source} at module level")
    assert not problems, "\n".join(problems)


def _reads(tree: ast.AST):
    """``(key, line)`` for every string read from a mapping: ``x.get("key")``, ``x["key"]``, a dict literal's key."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "select") \
                and node.args:
            arg = node.args[-1] if node.func.attr == "select" else node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value.split(".")[0], node.lineno
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            yield node.slice.value, node.lineno
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    yield key.value.split(".")[0], key.lineno


def test_no_technique_key_is_read_as_a_raw_string_outside_the_techniques():
    # A technique's keys reach the code that acts on them typed (MemoryConfig, LoraConfig) or through the
    # technique's own methods; only the techniques read them from a config by name (their interactions included).
    from mtune.training.memory.registry import TECHNIQUES

    keys = {key.name for technique in TECHNIQUES for key in technique.Settings.keys()}
    problems = [f"{name}:{line} reads {key!r}"
                for name, tree in _modules().items() if not _within(name, TECHNIQUES_PACKAGE)
                for key, line in _reads(tree) if key in keys]
    assert not problems, "\n".join(problems)


MEMORY_PACKAGE = "mtune.training.memory"
RECIPES = Path(mtune.__file__).parent.parent / "recipes"


def _technique_keys() -> set[str]:
    from mtune.training.memory.registry import TECHNIQUES

    return {key.name for technique in TECHNIQUES for key in technique.Settings.keys()}


def _outside_memory() -> dict[str, ast.Module]:
    """Every module of mtune outside the memory package, and the recipes."""
    modules = {name: tree for name, tree in _modules().items() if not _within(name, MEMORY_PACKAGE)}
    for path in sorted(RECIPES.glob("*.py")):
        modules[f"recipes.{path.stem}"] = ast.parse(path.read_text(), filename=str(path))
    return modules


def test_the_run_imports_no_technique():
    # Outside the memory package, the run reaches the techniques through the registry and the phases only: no
    # module of mtune and no recipe imports a technique's package.
    problems = [f"{name}:{line} imports {source}"
                for name, tree in _outside_memory().items()
                for source, _, line in _imports(tree) if _within(source, TECHNIQUES_PACKAGE)]
    assert not problems, "\n".join(problems)


def _config_like(node: ast.AST) -> bool:
    """A config or the run's memory settings: ``cfg``, ``config``, ``memory``, ``self.cfg`` and the like."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("cfg", "config", "memory", "run_cfg", "answer_cfg")


def test_no_technique_key_is_read_as_an_attribute_or_tested_with_in_outside_the_techniques():
    # ``cfg.fsdp_cpu_offload``, ``memory.compile`` or ``"lora" in cfg`` outside the memory package would act on a
    # technique's key by hand; the technique's own hooks do (``lora`` is read as the LoRA recipes' method node).
    keys = _technique_keys() - {"lora"}
    problems = []
    for name, tree in _outside_memory().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in keys and _config_like(node.value):
                problems.append(f"{name}:{node.lineno} reads .{node.attr}")
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                    and node.left.value in keys and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                problems.append(f"{name}:{node.lineno} tests {node.left.value!r} in ...")
    assert not problems, "\n".join(problems)


def _module_level_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for source, imported, _ in _imports(node):
                    target = f"{source}.{imported}" if f"{source}.{imported}" in modules else source
                    if target in modules and target != name:
                        graph[name].add(target)
    return graph


def test_no_import_circle():
    # Tarjan's strongly connected components over module-level imports: any component of two or more modules
    # is a circle (a declaration and its implementation importing each other, say).
    graph, index, low, stack, on_stack, circles = _module_level_graph(), {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, circles


LONG_MODULES_ALLOWED = 1
"""Modules over 300 lines (``mtune/``): at most this many."""


def test_modules_stay_short():
    long = sorted((len(path.read_text().splitlines()), str(path.relative_to(PACKAGE.parent)))
                  for path in PACKAGE.rglob("*.py") if len(path.read_text().splitlines()) > 300)
    assert len(long) <= LONG_MODULES_ALLOWED, long


def _class_members(tree: ast.Module, class_name: str) -> list[str]:
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    names = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AnnAssign, ast.Assign)):
            name = (node.name if isinstance(node, ast.FunctionDef) else
                    node.target.id if isinstance(node, ast.AnnAssign) else node.targets[0].id)
            names.append(name)
    return [name for name in names if not name.startswith("_")]


def test_the_technique_contract_is_small_and_every_member_is_called_by_the_machinery():
    # About a dozen members, each read by the orchestrator, the registry or the planner (a member nothing reads is
    # a hook added for one technique that no phase calls); the same for the weight phases.
    modules = _modules()
    contract = modules["mtune.training.memory.technique"]
    machinery = {name: tree for name, tree in modules.items()
                 if not _within(name, TECHNIQUES_PACKAGE) and name != "mtune.training.memory.technique"}
    read = {node.attr for tree in machinery.values() for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    members = _class_members(contract, "MemoryTechnique")
    weight_phases = _class_members(contract, "WeightPhases")
    assert len(members) <= 13, members
    assert not [m for m in members + weight_phases if m not in read], "members nothing outside the techniques reads"
