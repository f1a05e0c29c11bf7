"""Import a script of scripts/ or benchmarks/ as a module (neither folder is a package)."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str, folder: str = "scripts"):
    """``<folder>/<name>.py`` imported as the module ``name`` (once: later calls return the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
