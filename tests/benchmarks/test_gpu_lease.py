"""scripts/gpu_lease.sh, the calls of a GPU lease: a mistake in one costs minutes of a 15-minute lease, so what can be
checked without a GPU is checked here: the cases each item runs exist in benchmarks/gpu_suite.py, and what an item
reads from the working tree is among the paths its header line says to carry."""

import re
import subprocess
from pathlib import Path

from tests._helpers.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_lease.sh"
TEXT = SCRIPT.read_text()
suite = load_script("gpu_suite", "benchmarks")


def _items() -> dict[str, str]:
    """Each item's branch of the script's ``case`` statement: ``{"1": its body, ...}``."""
    body = TEXT[TEXT.index('case "$item" in'):TEXT.index("esac")]
    return {m.group(1): m.group(2) for m in re.finditer(r"^  (\d)\)\n(.*?);;", body, re.S | re.M)}


def _functions() -> dict[str, str]:
    """The script's shell functions, ``name() { body }`` on one or more lines: ``{name: body}``."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w+)\(\) \{(.*?)\}$", TEXT, re.S | re.M)}


def _reads(body: str) -> set[str]:
    """The working-tree paths (under .whl or .whl_triton) a piece of the script reads, with those of the functions
    it calls: ``.whl/base/*.whl`` reads ``.whl/base``."""
    functions = _functions()
    called = [functions[name] for name in functions if re.search(rf"^\s*{name}\b", body, re.M)]
    return {re.sub(r"/\*\.whl$", "", path) for text in (body, *called)
            for path in re.findall(r"(\.whl[\w/.*]*)", text)}


def _carry() -> dict[str, list[str]]:
    """The header's ``#   N: paths  what it runs`` lines: the working-tree paths item N carries."""
    return {m.group(1): [p for p in m.group(2).split() if p.startswith(".")]
            for m in re.finditer(r"^#   (\d): (.*)$", TEXT, re.M)}


def test_every_item_runs_cases_the_suite_has():
    names = {case.name for case in suite.CASES}
    items = _items()
    assert sorted(items) == ["1", "2", "3", "4", "5", "6"]
    for item, body in items.items():
        # an item may let CASES narrow its list: ${CASES:-a b} runs a and b unless CASES is set
        cases = re.sub(r"\$\{CASES:-([^}]*)\}", r"\1", body.split("--cases", 1)[1].replace("\\\n", " ")).split()
        assert cases and set(cases) <= names, f"item {item}: {sorted(set(cases) - names)} not in gpu_suite.CASES"


def test_what_an_item_reads_from_the_tree_is_what_its_header_says_to_carry():
    carry, items = _carry(), _items()
    assert sorted(carry) == sorted(items)
    for item, body in items.items():
        read = _reads(body)
        missing = [path for path in read if not any(path == c or path.startswith(c + "/") for c in carry[item])]
        assert not missing, f"item {item} reads {missing} but its header carries {carry[item]}"


def test_a_function_an_item_calls_reads_from_the_tree_for_it():
    assert {".whl", ".whl/base"} <= _reads("    install_site\n")  # its wheels, though the item names none
    assert _reads("    versions\n") == set()


def test_an_unknown_item_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "9"], env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == "no item 9 (1-6)"
    assert list(tmp_path.iterdir()) == []
