"""Every memory and speed figure in README.md, docs/*.md and the shipped configs' hand-made headers comes from the
results file cited nearest it (scripts/check_figures.py says how a figure is matched), and the checker can fail.

The figures that no committed results file gives yet are listed in tests/docs/unsourced_figures.txt: the list may
only shrink. A figure not on it fails with its file:line; a listed figure that is now sourced (or gone) fails too,
so the list is kept exact."""

import collections
import json

import pytest

from tests._helpers.scripts import REPO, load_script

check = load_script("check_figures")
KNOWN = REPO / "tests" / "docs" / "unsourced_figures.txt"


def _known() -> collections.Counter:
    lines = [line for line in KNOWN.read_text().splitlines() if line and not line.startswith("#")]
    return collections.Counter(tuple(line.split("\t")) for line in lines)


def test_every_figure_is_sourced_by_its_nearest_results_file():
    """Mutation: README's 1.04–1.31× edited to 1.04–1.41× fails here with README.md:72."""
    stated: list = []
    missing = check.unsourced(check.all_figures(stated))
    found = collections.Counter((f.path, f.text) for f in missing)
    known = _known()
    new = [f"{f.path}:{f.line}: {f.text!r} (sources: {', '.join(f.sources) or 'none cited'})"
           for f in missing if found[(f.path, f.text)] > known[(f.path, f.text)]]
    assert not new, "figures no cited results file gives:\n" + "\n".join(new)
    stale = sorted((known - found).elements())
    assert not stale, ("listed in tests/docs/unsourced_figures.txt but sourced or gone now (remove them): "
                       + "; ".join(f"{p}: {t!r}" for p, t in stale))


def test_stated_marks_give_a_reason_and_mark_a_figure():
    """``<!-- stated: why -->`` exempts the figures of its line (inputs, thresholds, datasheet figures); each says
    why and sits on a line with a figure, and they stay few."""
    stated: list = []
    check.all_figures(stated)
    for path, line, reason in stated:
        assert len(reason.split()) >= 2, f"{path}:{line}: a stated mark without its reason"
        text = (REPO / path).read_text().splitlines()[line - 1]
        assert check.FIGURE.search(check._prose(text)), f"{path}:{line}: a stated mark on a line without a figure"
    assert len(stated) <= 40


@pytest.fixture
def tiny_repo(tmp_path, monkeypatch):
    """A repository of one doc and one results file, for the checker alone."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "runs.json").write_text(json.dumps({"machine": "2-core CPU", "date": "2026-11-25", "rows": [
        {"case": "lora", "peak_bytes": 1.5 * 2**30, "tokens_per_second": 812.4, "speedup": 1.26, "mfu": 0.883},
        {"case": "qlora", "peak_bytes": 0.9 * 2**30, "tokens_per_second": 640.0, "speedup": 1.04, "mfu": 0.61}]}))
    monkeypatch.setattr(check, "REPO", tmp_path)
    monkeypatch.setattr(check, "RESULTS", results)
    check.results_file.cache_clear()
    yield tmp_path
    check.results_file.cache_clear()


def _unsourced(root, text):
    doc = root / "doc.md"
    doc.write_text(text)
    return [f.text for f in check.unsourced(check.markdown_figures(doc))]


@pytest.mark.parametrize("figure, sourced", [
    ("1.50 GiB", True), ("1.5 GiB", True), ("1,536 MiB", True),   # bytes at the printed precision
    ("1.61 GiB", False), ("3.0 GiB", False),                      # 7% off, 2x
    ("0.9 GiB", False),                                           # the other record's figure
    ("1.26 GiB", False),                                          # the speedup's number, not a memory
])
def test_a_table_row_is_checked_against_the_record_it_names(tiny_repo, figure, sourced):
    """Mutation: every number of the file instead of the named record's let the 0.9 GiB case pass."""
    text = ("Peaks (`benchmarks/results/runs.json`):\n\n| case | peak |\n|---|---:|\n"
            f"| lora | {figure} |\n")
    assert (_unsourced(tiny_repo, text) == []) is sourced


@pytest.mark.parametrize("sentence, unsourced", [
    ("LoRA runs at 812 tok/s, 1.26× the other library, 88% MFU.", []),
    ("LoRA runs at 869 tok/s, 1.35× the other library, 94% MFU.", ["869 tok/s", "1.35×", "94%"]),  # +7%
    ("LoRA runs at 640 tok/s.", ["640 tok/s"]),       # QLoRA's number: the clause names LoRA's record
    ("QLoRA runs at 640 tok/s and 1.04×.", []),
])
def test_prose_is_checked_against_the_record_its_clause_names(tiny_repo, sentence, unsourced):
    """Mutation: every number of the file instead of the named record's let QLoRA's 640 tok/s pass for LoRA."""
    text = f"# Speed\n\nFrom benchmarks/results/runs.json. {sentence}\n"
    assert _unsourced(tiny_repo, text) == unsourced


@pytest.mark.parametrize("figure, unsourced", [
    ("−0.9%", []), ("-0.9%", []),              # the plan's error with its sign, either minus
    ("+0.9%", ["+0.9%"]), ("0.9%", ["0.9%"]),  # the sign dropped or flipped is another figure
])
def test_a_signed_figure_keeps_its_sign(tiny_repo, figure, unsourced):
    """A plan's error of -0.9% is a different figure from +0.9%. Mutation: the checker as it was, without signs,
    let "+0.9%" pass and failed both minus signs."""
    (tiny_repo / "benchmarks" / "results" / "plans.json").write_text(json.dumps({"rows": [
        {"case": "lora", "plan_error": -0.0088}]}))
    text = f"# Plans\n\nFrom benchmarks/results/plans.json. LoRA is planned {figure} off.\n"
    assert _unsourced(tiny_repo, text) == unsourced


def test_only_the_nearest_cited_file_counts(tiny_repo):
    """A figure whose paragraph cites another file is not matched against the section's file. Mutation: the union
    of every level's sources instead of the nearest let 812 tok/s pass."""
    (tiny_repo / "benchmarks" / "results" / "other.json").write_text(json.dumps({"seconds": 3.0}))
    text = ("# Speed (`benchmarks/results/runs.json`)\n\nThe LoRA step gives 812 tok/s.\n\n"
            "Planning took 3.0 s (`benchmarks/results/other.json`); the LoRA step 812 tok/s.\n")
    assert _unsourced(tiny_repo, text) == ["812 tok/s"]


def test_a_figure_citing_nothing_fails_and_a_stated_one_is_exempt(tiny_repo):
    text = "# Budget\n\nA 24 GiB GPU.\n\nOn a 24 GiB GPU. <!-- stated: the user's GPU, an input -->\n"
    assert _unsourced(tiny_repo, text) == ["24 GiB"]


def test_a_range_is_the_least_and_most_of_one_quantity_of_one_file(tiny_repo):
    """Both ends of a range come from one key of one file: not one from each file, nor from two quantities.
    Mutation: grouping the ends by key only (not by file) let 1.04–1.50× pass."""
    (tiny_repo / "benchmarks" / "results" / "other.json").write_text(json.dumps({"speedup": 1.5, "ratio_x": 2.0}))
    line = "Speedups {} (`benchmarks/results/runs.json`, `benchmarks/results/other.json`).\n"
    assert _unsourced(tiny_repo, line.format("1.04–1.26×")) == []
    assert _unsourced(tiny_repo, line.format("1.04–1.50×")) == ["1.04–1.50×"]  # one end from each file
    assert _unsourced(tiny_repo, line.format("1.26–1.5×")) == ["1.26–1.5×"]


def test_a_row_labelled_in_inline_code_names_its_record(tiny_repo):
    """Config and command names are written as code; they still name the row's record. Mutation: labels taken after
    inline code was stripped matched QLoRA's 0.9 GiB against every number of the file, and it passed."""
    text = "Peaks (`benchmarks/results/runs.json`):\n\n| case | peak |\n|---|---:|\n| `lora` | {} |\n"
    assert _unsourced(tiny_repo, text.format("1.50 GiB")) == []
    assert _unsourced(tiny_repo, text.format("0.9 GiB")) == ["0.9 GiB"]


def test_a_runs_config_names_none_of_its_results(tiny_repo):
    """A row's ``config`` object holds the run's inputs, not results: it is no record, so prose that names a config
    value ("fp32") still reaches the row's numbers, and the other row's number still fails. Mutation: ``config``
    records kept (the key dropped from the excluded ones) made the selective run's 315.8 MiB unsourced."""
    rows = [{"name": name, "config": {"name": name, "policy": policy, "dtype": "fp32"},
             "activations_bytes": mib * 2**20}
            for name, policy, mib in (("selective run", "selective_op", 315.8), ("plain run", "block", 451.8))]
    (tiny_repo / "benchmarks" / "results" / "cfg.json").write_text(json.dumps({"rows": rows}))
    text = "# Runs\n\nFrom benchmarks/results/cfg.json: the selective run in fp32 keeps {}.\n"
    assert _unsourced(tiny_repo, text.format("315.8 MiB")) == []
    assert _unsourced(tiny_repo, text.format("451.8 MiB")) == ["451.8 MiB"]
