"""Check that every memory and speed figure in README.md, docs/*.md and the shipped configs' headers comes from a
committed results file.

A figure is a number with a unit of memory, time, speed or ratio (``18.1 GiB``, ``1130 tok/s``, ``1.26×``, ``88%``,
``56 CPU-s``) in prose or a table; code blocks and inline code are commands and inputs, not figures. A figure is
sourced when a number of its results file gives it at the precision printed: as is, bytes as MiB/GiB/GB, a fraction
as a percentage, seconds as milliseconds or minutes (a range ``1.04–1.26×`` needs both ends).

Which results file: the one cited nearest. A source is a path under ``benchmarks/results/`` (a file, or a run's
directory: its files), ``results/<file>``, or a benchmark script ``benchmarks/<name>.py`` (its results are
``benchmarks/results/<name>*``). The sources named on the figure's own line are used if there are any; else those of
its paragraph or list item; else, in a table, those of the table and the paragraph just above it (its caption);
else those of its section, then of each parent section. Only that nearest level counts: a figure is not matched
against a file cited further away.

Which numbers of that file: those of the record the figure names. A JSON file is a tree of records (objects); a
markdown results file's table rows are records too. A table row names the records whose short string fields are
among its cells; prose names them by whole words in the figure's clause (between commas, semicolons or colons),
else in its line (not for a range, which spans records); each string weighs 1 / the number of records holding it,
and the best-named records give the numbers (every number in them, strings included). Only when none is named does
the whole file count. A number gives only figures of a unit its kind allows: the kind its JSON key, its table
column or the unit printed after it names (bytes, GiB, MiB, seconds, tok/s, a fraction, a ratio, a rate), none for
the machine's description (load averages, thread counts, steps). A run's ``machine``, ``meta`` and ``config``
objects are not records. A range's two ends must be values of one key of one file: the least and the most of one
quantity.

A config header (the comment lines above ``recipe:`` in ``recipes/configs/**.yaml``) is sourced from
``benchmarks/results/plan_configs.json``'s record of that config unless a header line names another file.

Inputs and thresholds are not measurements ("a 24 GiB GPU", a datasheet's TFLOP/s): mark such a line with
``<!-- stated: why -->`` at its end and its figures are not checked; the checker counts the marks.

    python scripts/check_figures.py            # lists the unsourced figures, exits 1 if any
    python scripts/check_figures.py --power    # also: how many sourced figures would still pass if wrong
                                               # (writes benchmarks/results/figure_check_power.json)
    python scripts/check_figures.py --known > tests/docs/unsourced_figures.txt   # the list the test reads
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIGS = REPO / "recipes" / "configs"
UNITS = r"GB/s|TFLOP/s|GiB|GB|MiB|MB|KiB|TiB|tok/s|tokens/s|samples/s|×|x faster|%|CPU-s|ms|s\b|min\b"
NUM = r"\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.])([-−+]?(?:{NUM}))\s?(?:(?:–|-|to )({NUM})\s?)?({UNITS})(?!\s?\d)")
"""A figure: a number, signed when a sign touches it (``−0.9%``, ``+2.4%``: a plan's error is matched with its
sign), or a range of two, then its unit."""
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
SOURCE = re.compile(r"benchmarks/results/[\w./-]*[\w/]|benchmarks/(\w+)\.py"
                    r"|(?<![\w/])results/([\w.-]+\.(?:json|md|txt))")
STATED = re.compile(r"<!--\s*stated:\s*(.*?)\s*-->")
DATA_SUFFIXES = (".json", ".md", ".txt", ".csv", ".jsonl")


@dataclass(frozen=True)
class Figure:
    """One figure of a document: ``numbers`` as printed (one, or a range's two ends), the ``sources`` cited nearest
    it and the words (``labels``) that name its record. ``table_row``: the labels are a row's cells."""
    path: str
    line: int
    text: str
    numbers: tuple[str, ...]
    unit: str
    sources: tuple[str, ...]
    labels: tuple[str, ...]
    table_row: bool


# What a number of a results file is, from its JSON key, its table column's header or the unit printed after it;
# "any" where none says. A number of a kind gives figures of the units compatible with it, at these scales; the
# machine's description ("meta": load averages, thread counts, steps) gives none.
KINDS = (("bytes", r"bytes"), ("GiB", r"gib"), ("MiB", r"mib"), ("tok/s", r"tok(en)?s?_?(/|per_?)s"),
         ("frac", r"mfu|hfu|ceiling|accuracy|exact_match|fraction|share|error|utili[sz]ation"),
         ("ratio", r"ratio|speedup|×|÷"), ("rate", r"per_?s(ec(ond)?)?$|/s$"), ("pct", r"%|percent|pct"),
         ("ms", r"(^|_)ms$"),
         ("s", r"(^|_)(s|seconds?|secs?|cpu_s|wall_s|time_s)$|\(s\)|seconds"),
         ("meta", r"load|thread|cpus|cpu_count|seed|warmup|(^|_)(reps?|runs|steps?|date)$"))
COMPATIBLE = {  # figure unit: {kind: scales}
    **{u: {"bytes": (2.0**-e,), u: (1,), "any": (1, 2.0**-e)}
       for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10), ("TiB", 40))},
    "MiB": {"bytes": (2.0**-20,), "MiB": (1,), "GiB": (1024,), "any": (1, 2.0**-20)},
    "GB": {"bytes": (1e-9,), "any": (1, 1e-9)}, "MB": {"bytes": (1e-6,), "any": (1, 1e-6)},
    "%": {"frac": (100,), "pct": (1,), "ratio": (100,), "any": (1, 100)},
    "×": {"ratio": (1,), "frac": (1,), "any": (1,)}, "x faster": {"ratio": (1,), "any": (1,)},
    "s": {"s": (1,), "any": (1,)}, "CPU-s": {"s": (1,), "any": (1,)},
    "ms": {"s": (1000,), "ms": (1,), "any": (1, 1000)},
    "min": {"s": (1 / 60,), "any": (1, 1 / 60)}, "tok/s": {"tok/s": (1,), "any": (1,)},
    "tokens/s": {"tok/s": (1,), "any": (1,)}, "samples/s": {"any": (1,)},
    "TFLOP/s": {"rate": (1, 1e-12), "any": (1, 1e-12)}, "GB/s": {"rate": (1, 1e-9), "any": (1, 1e-9)},
}
UNIT_AFTER = re.compile(rf"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)\s?({UNITS}|seconds|B\b)?")


def kind(name: str) -> str:
    """The kind of number a JSON key or a column header names ("any" where it names none)."""
    name = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, name)), "any")


Values = frozenset  # of (kind, value)


@dataclass
class Record:
    """A JSON object or a markdown table row: its short string fields and every number in it, with its kind."""
    strings: frozenset[str]
    values: Values


@dataclass
class ResultsFile:
    records: list[Record] = field(default_factory=list)
    values: set[tuple[str, str, float]] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------------------- sources


def _numbers(text: str, default: str = "any", key: str = "") -> set[tuple[str, str, float]]:
    """The numbers of a text as ``(kind, key, value)``: the kind of the unit printed after each (else ``default``)."""
    out = set()
    for match in UNIT_AFTER.finditer(text.replace(",", "")):
        unit = match.group(2)
        out.add((kind(unit) if unit and kind(unit) != "any" else
                 {"s": "s", "ms": "ms", "B": "bytes", "seconds": "s"}.get(unit or "", default), key,
                 float(match.group(1))))
    return out


def _table_records(text: str, records: list[Record]) -> None:
    """Appends a record for each row of the markdown tables in ``text``: its label cells, and its numbers of the
    kind each column's header names."""
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            header = []
        elif line.startswith("|-"):
            continue
        elif not header:
            header = _cells(line)
        else:
            cells = _cells(line)
            row = set()
            for i, cell in enumerate(cells):
                column = header[i] if i < len(header) else ""
                row |= _numbers(cell, kind(column), column)
            records.append(Record(frozenset(_label_cells(cells)), Values(row)))


def _json_records(node, records: list[Record], key: str = "") -> set[tuple[str, str, float]]:
    """Every number under ``node`` (strings' numbers included) as ``(kind, key, value)``, the kind its key names;
    appends a record for each object with a short string field."""
    if isinstance(node, bool) or node is None:
        return set()
    if isinstance(node, (int, float)):
        return {(kind(key), key, float(node))}
    if isinstance(node, str):
        if "\n|" in node:  # a markdown table the benchmark wrote into its JSON: its rows are records too
            _table_records(node, records)
        return _numbers(node, kind(key), key)
    items = node.items() if isinstance(node, dict) else ((key, child) for child in node)
    values: set[tuple[str, str, float]] = set()
    for child_key, child in items:
        values |= _json_records(child, records, child_key)
    # where a run ran, and what it was given (its "config": dtype, policy, the row's own name again), name none of
    # its results: such an object is no record, or a clause naming "fp32" would pick the inputs over the row (a
    # head-to-head's first_step_parity names only its dtype; its losses stay the row's numbers)
    if isinstance(node, dict) and key not in ("machine", "meta", "config", "first_step_parity"):
        strings = frozenset(v for v in node.values() if isinstance(v, str) and 2 <= len(v) <= 80
                            and not re.fullmatch(r"[\d\s:.+\-T/Z]+", v))  # a date names no record
        if strings:
            records.append(Record(strings, Values(values)))
    return values


def _cells(line: str) -> list[str]:
    return [cell.strip().strip("`*").strip() for cell in line.strip().strip("|").split("|")]


def _label_cells(cells: list[str]) -> tuple[str, ...]:
    """A row's cells that name it: not figures, not plain numbers."""
    return tuple(c for c in cells if c and not FIGURE.search(c) and not re.fullmatch(r"[-\d.,\s×→/–:]*", c))


@lru_cache(maxsize=None)
def results_file(name: str) -> ResultsFile:
    """The records and numbers of a results file, or of every file of a results directory."""
    path = REPO / name
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = ResultsFile()
    for file in files:
        if file.suffix in DATA_SUFFIXES:
            _read_results(file, out)
    return out


def _read_results(file: Path, out: ResultsFile) -> None:
    """Adds one file's records and numbers to ``out``, each number's key prefixed by the file (a range's two ends
    must come from one file's key)."""
    first_record, values = len(out.records), set()
    text = file.read_text(errors="replace")
    try:
        values = _json_records(json.loads(text), out.records) if file.suffix == ".json" else None
    except json.JSONDecodeError:
        values = None
    if values is None:
        values = _numbers(text)
        _table_records(text, out.records)

    def by_file(numbers):
        return {(k, f"{file}:{key}" if key else "", v) for k, key, v in numbers}

    out.values |= by_file(values)
    for record in out.records[first_record:]:
        record.values = Values(by_file(record.values))


def _sources_named(text: str) -> set[str]:
    named = set()
    for match in SOURCE.finditer(text):
        if match.group(1):  # a benchmark script: its results files share its name
            named.update(str(p.relative_to(REPO)) for p in RESULTS.glob(f"{match.group(1)}*"))
        elif match.group(2):
            named.add(f"benchmarks/results/{match.group(2)}")
        else:
            named.add(match.group(0).rstrip("/."))
    return {name for name in named if (REPO / name).exists() and name != "benchmarks/results"}


def _named(label: str, context: str, table_row: bool, cells: tuple[str, ...]) -> bool:
    if table_row:
        return label.lower() in cells
    return re.search(rf"(?<![\w/.-]){re.escape(label)}(?![\w/-])", context, re.I) is not None


def _scoped(records: list[Record], context: str, figure: Figure) -> set[float] | None:
    """The numbers of the records ``context`` names best, each string weighted by how few records hold it (a case
    name shared by every run names less than a config's path); None when it names none."""
    holders: dict[str, int] = {}
    for record in records:
        for s in record.strings:
            holders[s] = holders.get(s, 0) + 1
    cells = tuple(c.lower() for c in figure.labels) if figure.table_row else ()
    weight = {s: 1 / n for s, n in holders.items() if _named(s, context, figure.table_row, cells)}
    best, scoped = 0.0, set()
    for record in records:
        score = sum(weight.get(s, 0.0) for s in record.strings)
        if score > best + 1e-12:
            best, scoped = score, set(record.values)
        elif score and abs(score - best) <= 1e-12:
            scoped |= record.values
    return scoped if best else None


def candidate_values(figure: Figure) -> tuple[set[float], bool]:
    """The numbers that may give ``figure``: those of the records named best by its clause (prose: the words between
    the commas, semicolons or colons around it), else by its line (a range: its clause only; a table row: its
    label cells), in its sources; no record named, every number of its sources. Second: whether records were
    named."""
    records = [r for source in figure.sources for r in results_file(source).records]
    # a range spans records (its ends are the least and the most of several): only its own clause may scope it
    contexts = ("",) if figure.table_row else figure.labels[:1] if len(figure.numbers) > 1 else figure.labels
    for context in contexts:
        scoped = _scoped(records, context, figure)
        if scoped is not None:
            return scoped, True
    return {v for source in figure.sources for v in results_file(source).values}, False


def _given(number: str, unit: str, values) -> bool:
    """Whether a number of a compatible kind gives ``number`` (a figure's, in ``unit``) at its printed precision."""
    digits = len(number.split(".")[1]) if "." in number else 0
    target = float(number.replace(",", "").replace("−", "-"))
    tolerance = 0.5 * 10**-digits + 1e-9
    compatible = COMPATIBLE.get(unit, {"any": (1,)})
    return any(abs(value * scale - target) <= tolerance
               for k, _, value in values for scale in compatible.get(k, ()))


def _gives(numbers: tuple[str, ...], unit: str, values) -> bool:
    """Whether ``values`` give a figure's numbers: a range's two ends must be values of one key (a JSON key or a
    table column: the least and the most of one quantity), not any two numbers of the file."""
    if len(numbers) == 1:
        return _given(numbers[0], unit, values)
    by_key: dict[str, set] = {}
    for value in values:
        if value[1]:
            by_key.setdefault(value[1], set()).add(value)
    return any(all(_given(n, unit, same) for n in numbers) for same in by_key.values())


def sourced(figure: Figure) -> bool:
    values, _ = candidate_values(figure)
    return _gives(figure.numbers, figure.unit, values)


# -------------------------------------------------------------------------------------------------------- documents


def _prose(line: str) -> str:
    line = re.sub(r"`[^`]*`", "", line)
    line = re.sub(r"<!--.*?-->", "", line)
    return re.sub(r"\]\([^)]*\)", "]", line)  # link targets


def markdown_figures(doc: Path, stated: list[tuple[str, int, str]] | None = None) -> list[Figure]:
    """Every figure of a markdown document, with the sources cited nearest it."""
    lines = doc.read_text().splitlines()
    name = str(doc.relative_to(REPO)) if doc.is_relative_to(REPO) else str(doc)
    # per line: its section, item (paragraph or list item) and block (run of non-blank lines; a table + its caption)
    section_of, item_of, block_of = [], [], []
    parents, levels, section_sources = [-1], [0], [set()]
    item_sources: list[set[str]] = []
    block_sources: list[set[str]] = []
    in_code, current, previous_blank, previous_table = False, 0, True, False
    for line in lines:
        fence = line.lstrip().startswith("```")
        heading = None if in_code or fence else re.match(r"(#+) ", line)
        if heading:
            level = len(heading.group(1))
            parent = current
            while levels[parent] >= level:
                parent = parents[parent]
            parents.append(parent)
            levels.append(level)
            section_sources.append(set())
            current = len(levels) - 1
        named = _sources_named(re.sub(r"<!--.*?-->", "", line))
        section_sources[current] |= named
        blank = not line.strip() or heading is not None or fence or in_code
        if not blank:
            table = line.startswith("|")
            new_block = previous_blank or table != previous_table
            if new_block:
                block_sources.append(set())
                if table and len(block_sources) > 1 and _caption_above(lines, len(section_of)):
                    block_sources[-1] |= block_sources[-2]
            if new_block or table or re.match(r"\s*(?:[-*]|\d+\.) ", line):
                item_sources.append(set())
            item_sources[-1] |= named
            block_sources[-1] |= named
            previous_table = table
        section_of.append(current)
        item_of.append(len(item_sources) - 1 if not blank else -1)
        block_of.append(len(block_sources) - 1 if not blank else -1)
        if fence:
            in_code = not in_code
        previous_blank = blank
    found = []
    in_code = open_span = False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code or not line.strip():
            open_span = False
            continue
        # inline code may run over a line break: close it at the end of the line, reopen it on the next
        line = "`" + line if open_span else line
        open_span = line.count("`") % 2 == 1
        line = line + "`" if open_span else line
        if line.startswith("#"):
            continue
        mark = STATED.search(re.sub(r"`[^`]*`", "", line))
        prose = _prose(line)
        matches = list(FIGURE.finditer(prose))
        if mark:  # inline, so that it ends no paragraph (a comment alone on a line is an HTML block in markdown)
            if stated is not None:
                stated.append((name, number, mark.group(1)))
            if matches:
                continue
        i = number - 1
        # a table row's block is its table and caption; a list item's block (the whole list) says nothing of it
        levels_nearest = [_sources_named(re.sub(r"<!--.*?-->", "", line)),
                          item_sources[item_of[i]] if item_of[i] >= 0 else set(),
                          block_sources[block_of[i]] if block_of[i] >= 0 and line.startswith("|") else set()]
        section = section_of[i]
        while section >= 0:
            levels_nearest.append(section_sources[section])
            section = parents[section]
        sources = next((s for s in levels_nearest if s), set())
        table_row = line.startswith("|")
        for match in matches:
            # a row's label cells keep their inline code (a config's or a command's name is written as code)
            labels = (_label_cells(_cells(re.sub(r"<!--.*?-->", "", line))) if table_row
                      else (_clause(prose, match.start()), prose))
            numbers = tuple(n for n in (match.group(1), match.group(2)) if n)
            found.append(Figure(name, number, match.group(0), numbers, match.group(3), tuple(sorted(sources)),
                                labels, table_row))
    return found


def _clause(prose: str, at: int) -> str:
    """The part of ``prose`` around position ``at`` between commas, semicolons, colons or dashes (a bracket stays:
    "65.2% (QLoRA)" names its record inside one)."""
    bounds = [m.end() for m in re.finditer(r"[,;:]|\s—\s", prose[:at])]
    end = re.search(r"[,;:]|\s—\s", prose[at:])
    return prose[bounds[-1] if bounds else 0: at + end.start() if end else len(prose)]


def _caption_above(lines: list[str], index: int) -> bool:
    """Whether the paragraph ending before line ``index`` (a table's first row; blank lines skipped) ends with a
    colon: the table's caption, whose sources are the table's."""
    i = index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    return i >= 0 and lines[i].rstrip().endswith(":")


@lru_cache(maxsize=None)
def rendered_configs() -> frozenset[str]:
    """The configs whose header memory block scripts/render_plan_figures.py writes from plan_configs.json (checked by
    re-rendering: tests/docs/test_plan_figures.py)."""
    results = json.loads((RESULTS / "plan_configs.json").read_text())["results"]
    return frozenset(r["config"] for r in results)


def header_figures(config: Path) -> list[Figure]:
    """The figures of a shipped config's header (the comments above ``recipe:``) that scripts/render_plan_figures.py
    does not write: a header line's sources are the files it names, else its config's record of plan_configs.json."""
    name = str(config.relative_to(CONFIGS))[:-5]
    found, rendered = [], False
    for number, line in enumerate(config.read_text().splitlines(), 1):
        if line.startswith("recipe:"):
            break
        rendered = rendered or (line.startswith("# Memory planned") and name in rendered_configs())
        if rendered or not line.startswith("#"):
            continue
        prose = _prose(line)
        sources = tuple(sorted(_sources_named(prose))) or ("benchmarks/results/plan_configs.json",)
        for match in FIGURE.finditer(prose):
            numbers = tuple(n for n in (match.group(1), match.group(2)) if n)
            found.append(Figure(str(config.relative_to(REPO)), number, match.group(0), numbers, match.group(3),
                                sources, (_clause(prose, match.start()), prose + " " + name), False))
    return found


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def config_headers() -> list[Path]:
    return sorted(p for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "tiny")


def all_figures(stated: list | None = None) -> list[Figure]:
    return ([f for doc in documents() for f in markdown_figures(doc, stated)]
            + [f for config in config_headers() for f in header_figures(config)])


def unsourced(figures: list[Figure]) -> list[Figure]:
    return [f for f in figures if not sourced(f)]


# ------------------------------------------------------------------------------------------------------------ power


def _perturbed(number: str, factor: float) -> str | None:
    """``number`` times ``factor``, printed as ``number`` is; None where that prints the same."""
    digits = len(number.split(".")[1]) if "." in number else 0
    value = float(number.replace(",", "")) * factor
    text = f"{value:,.{digits}f}" if "," in number else f"{value:.{digits}f}"
    return None if float(text.replace(",", "")) == float(number.replace(",", "")) else text


def power(figures: list[Figure], factor: float) -> tuple[int, int]:
    """Of the sourced figures that ``factor`` changes at their printed precision: how many would still pass with
    every number multiplied by it, and how many were tried."""
    passed = tried = 0
    for f in figures:
        if not sourced(f):
            continue
        wrong = tuple(_perturbed(n, factor) for n in f.numbers)
        if any(w is None for w in wrong):
            continue
        tried += 1
        values, _ = candidate_values(f)
        passed += _gives(wrong, f.unit, values)
    return passed, tried


def write_power(figures: list[Figure], unsourced_count: int) -> None:
    """Print and write ``benchmarks/results/figure_check_power.json``: for each factor, how many of the sourced
    figures multiplied by it would still pass, over all of them, those scoped to a record and those matched against
    a whole file."""
    own = "benchmarks/results/figure_check_power.json"  # the figures that report this measure are not in it
    good = [f for f in figures if sourced(f) and own not in f.sources]
    scoped = [f for f in good if candidate_values(f)[1]]
    whole = [f for f in good if not candidate_values(f)[1]]
    rows = []
    for factor in (1.07, 0.93, 2.0):
        row = {"factor": factor}
        for name, group in (("all", good), ("scoped", scoped), ("whole_file", whole)):
            passed, tried = power(group, factor)
            row[name] = {"still_passing": passed, "tried": tried, "fraction": passed / max(tried, 1)}
        rows.append(row)
        print(f"x{factor}: {row['all']['still_passing']} of {row['all']['tried']} wrong figures still pass "
              f"({row['all']['fraction']:.0%}; scoped {row['scoped']['fraction']:.0%}, whole file "
              f"{row['whole_file']['fraction']:.0%})", file=sys.stderr)
    out = RESULTS / "figure_check_power.json"
    out.write_text(json.dumps({
        "command": "python scripts/check_figures.py --power",
        "date": datetime.date.today().isoformat(), "figures": len(figures), "unsourced": unsourced_count,
        "sourced": len(good), "sourced_scoped": len(scoped), "rows": rows}, indent=1) + "\n")
    print(f"json: {out.relative_to(REPO)}", file=sys.stderr)


KNOWN_HEADER = """\
# Figures in README.md, docs/*.md and config headers that no committed results file gives yet (path<TAB>figure).
# The list may only shrink: source a figure (name its results file beside it), restate it without a number, or
# mark an input with <!-- stated: why -->, and remove its line here."""


def main() -> int:
    stated: list[tuple[str, int, str]] = []
    figures = all_figures(stated)
    missing = unsourced(figures)
    if "--known" in sys.argv:  # tests/docs/unsourced_figures.txt as it should read now (review its diff: it may shrink)
        print("\n".join([KNOWN_HEADER] + [f"{f.path}\t{f.text}" for f in missing]))
        return 0
    for f in missing:
        where = ", ".join(f.sources) or "no results file cited in its paragraph or section"
        print(f"{f.path}:{f.line}: {f.text!r} not in {where}")
    print(f"{len(figures)} figures, {len(missing)} unsourced, {len(stated)} lines marked stated", file=sys.stderr)
    if "--power" in sys.argv:
        write_power(figures, len(missing))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
