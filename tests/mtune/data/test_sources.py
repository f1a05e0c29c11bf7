"""Every supported source gives the same samples; bad data gives a one-line error naming file, row and column."""

import gzip
import json
import sys

import pytest

from mtune.data import DataError, chat_dataset, instruct_dataset, text_completion_dataset
from tests._helpers.data import ALPACA_ROWS, write_rows


def samples(ds):
    return [ds[i] for i in range(len(ds))]


def test_every_format_gives_the_same_samples(tok, tmp_path):
    reference = samples(instruct_dataset(tok, "json", data_files=str(write_rows(ALPACA_ROWS, tmp_path / "a.jsonl"))))
    assert len(reference) == len(ALPACA_ROWS)
    sources = {
        "json array": dict(source=str(write_rows(ALPACA_ROWS, tmp_path / "b.json"))),
        "parquet": dict(source=str(write_rows(ALPACA_ROWS, tmp_path / "c.parquet"))),
        "csv by format name": dict(source="csv", data_files=str(write_rows(ALPACA_ROWS, tmp_path / "d.csv"))),
        "list of files": dict(source="json", data_files=[str(write_rows(ALPACA_ROWS[:2], tmp_path / "l/1.json")),
                                                         str(write_rows(ALPACA_ROWS[2:], tmp_path / "l/2.jsonl"))]),
        "directory of mixed files": dict(source=str(tmp_path / "l")),
        "split dict + glob": dict(source="parquet", data_files={"train": [str(tmp_path / "c*.parquet")]}),
    }
    for name, kwargs in sources.items():
        assert samples(instruct_dataset(tok, **kwargs)) == reference, name


def test_datasets_library_path(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    reference = samples(instruct_dataset(tok, str(write_rows(ALPACA_ROWS, tmp_path / "a.jsonl"))))
    datasets.Dataset.from_list(ALPACA_ROWS).save_to_disk(str(tmp_path / "saved"))
    assert samples(instruct_dataset(tok, str(tmp_path / "saved"))) == reference  # load_from_disk
    arrow = [str(p) for p in (tmp_path / "saved").glob("*.arrow")]
    # Not a local path or a native format: goes through datasets.load_dataset like a hub id (no network needed).
    ds = instruct_dataset(tok, "arrow", data_files=arrow, load_dataset_kwargs={"cache_dir": str(tmp_path / "hf")})
    assert samples(ds) == reference


def test_missing_datasets_library_says_how_to_install(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"tatsu-lab/alpaca.*pip install 'mtune\[datasets\]'"):
        instruct_dataset(tok, "tatsu-lab/alpaca")


def test_text_files_and_text_column_agree(tok, tmp_path):
    lines = ["The cat sat on the mat.", "Le chat.", "", "Third line here."]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    from_txt = samples(text_completion_dataset(tok, str(tmp_path / "t.txt")))
    # empty and blank texts (wikitext's rows between paragraphs) are dropped and counted, as .txt skips blank lines;
    # before, each trained a BOS-EOS sample
    rows = [{"body": line} for line in lines + ["   "]]
    jsonl = text_completion_dataset(tok, str(write_rows(rows, tmp_path / "t.jsonl")), column_map={"text": "body"})
    from_jsonl = samples(jsonl)
    assert from_txt == from_jsonl and len(from_txt) == 3 and jsonl.stats["dropped_fully_masked"] == 2
    first = from_txt[0]
    assert first["tokens"] == tok.encode(lines[0]) and first["labels"] == first["tokens"][1:] + [-100]
    whole = samples(text_completion_dataset(tok, str(tmp_path / "t.txt"), sample_by="document", max_seq_len=512))
    assert len(whole) == 1 and tok.decode(whole[0]["tokens"]) == "\n".join(lines) + "\n"


def test_byte_order_marks_and_unicode_line_separators_are_read_as_the_text_they_are(tok, tmp_path):
    """A UTF-8 byte-order mark (Windows editors, Excel's CSV UTF-8) was glued to a CSV's first column name (an optional
    column there read as absent: every input dropped), trained as text in a .txt, refused in JSON; U+2028 / U+0085
    inside a JSON Lines string split its line (a valid file refused as malformed)."""
    reference = samples(instruct_dataset(tok, str(write_rows(ALPACA_ROWS, tmp_path / "a.jsonl"))))
    columns = ["input", "instruction", "output"]  # the optional column first: its name took the mark
    csv_text = "\n".join(",".join(json.dumps(row[c]) for c in columns) for row in ALPACA_ROWS)
    (tmp_path / "bom.csv").write_text("\ufeff" + ",".join(columns) + "\n" + csv_text + "\n", encoding="utf-8")
    (tmp_path / "bom.jsonl").write_text("\ufeff" + "".join(json.dumps(r) + "\r\n" for r in ALPACA_ROWS))
    (tmp_path / "bom.json").write_text("\ufeff" + json.dumps(ALPACA_ROWS))
    for name in ("bom.csv", "bom.jsonl", "bom.json"):
        assert samples(instruct_dataset(tok, str(tmp_path / name))) == reference, name
    (tmp_path / "bom.txt").write_text("\ufeffThe cat sat.\nSecond line.\n", encoding="utf-8")
    assert samples(text_completion_dataset(tok, str(tmp_path / "bom.txt")))[0]["tokens"] == tok.encode("The cat sat.")
    rows = [dict(ALPACA_ROWS[0], output="5\u2028(two and three)"), dict(ALPACA_ROWS[1], input="a\x85b")]
    (tmp_path / "u.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert samples(instruct_dataset(tok, str(tmp_path / "u.jsonl"))) == samples(
        instruct_dataset(tok, str(write_rows(rows, tmp_path / "u.json"))))


BAD_CASES = [
    ("missing column in a row", "rows.jsonl",
     lambda p: p.write_text(json.dumps(ALPACA_ROWS[0]) + "\n" + json.dumps({"instruction": "x", "input": ""}) + "\n"),
     {}, r"rows\.jsonl line 2: missing column 'output'"),
    ("empty field in a csv row", "rows.csv",
     lambda p: p.write_text("instruction,output\nhi,there\nno answer\n"),
     {}, r"rows\.csv row 2: column 'output' is empty \(null\): every row needs its output$"),
    # the first row: not "no column 'output' ... available columns: instruction, output"
    ("empty field in the first csv row", "rows.csv", lambda p: p.write_text("instruction,output\nno answer\n"),
     {}, r"rows\.csv row 1: column 'output' is empty \(null\)"),
    ("null value", "rows.jsonl", lambda p: write_rows([ALPACA_ROWS[0], {"instruction": "x", "output": None}], p),
     {}, r"rows\.jsonl line 2: column 'output' is empty \(null\)"),
    ("malformed JSON line", "rows.jsonl",
     lambda p: p.write_text(json.dumps(ALPACA_ROWS[0]) + "\n" + '{"instruction": "x",\n'),
     {}, r"rows\.jsonl line 2: malformed JSON"),
    ("JSON array cut short", "rows.json", lambda p: p.write_text(json.dumps(ALPACA_ROWS)[:-1] + "\n"),
     {}, r"rows\.json: malformed JSON, the file ends inside its array \(.*\): is it cut short\?$"),
    ("gzip-compressed, by suffix", "rows.jsonl.gz", lambda p: p.write_bytes(gzip.compress(b"{}\n")),
     {}, r"rows\.jsonl\.gz: gzip-compressed: mtune reads data files uncompressed"),
    ("gzip-compressed, named .jsonl", "rows.jsonl", lambda p: p.write_bytes(gzip.compress(b"{}\n")),
     {}, r"rows\.jsonl: gzip-compressed: mtune reads data files uncompressed"),
    ("not Parquet", "rows.parquet", lambda p: p.write_text("instruction,output\na,b\n"),
     {}, r"rows\.parquet: not a readable Parquet file \(.*magic bytes.*\)$"),
    ("wrong column_map", "rows.jsonl", lambda p: write_rows(ALPACA_ROWS, p),
     {"column_map": {"output": "answer"}},
     r"rows\.jsonl line 1: no column 'answer' \(needed as 'output'\); available columns: instruction, input, output"),
    ("unknown column_map key", "rows.jsonl", lambda p: write_rows(ALPACA_ROWS, p),
     {"column_map": {"response": "output"}}, r"column_map: 'response' is not a column this dataset reads"),
    ("empty dataset", "rows.jsonl", lambda p: p.write_text("\n"), {}, r"rows\.jsonl: the dataset is empty"),
    ("every sample fully masked", "rows.jsonl", lambda p: write_rows(ALPACA_ROWS, p),
     {"max_seq_len": 8}, r"all 6 samples are fully masked"),
    ("non-text value", "rows.jsonl", lambda p: write_rows([{"instruction": 3, "output": "x"}], p),
     {}, r"rows\.jsonl line 1: column 'instruction' must be text, got int"),
    # an unquoted comma: "What is 1" / "000 plus 1?" trained, 1001 dropped, without a word
    ("a csv row with more fields than its header", "rows.csv",
     lambda p: p.write_text("instruction,output\nName a colour.,Blue\nWhat is 1,000 plus 1?,1001\n"),
     {}, r"rows\.csv row 2: 3 fields, but the header names 2; quote a value that holds a comma"),
    # an optional column mapped to one the data lacks was read as empty: every instruction lost its input
    ("column_map to an absent optional column", "rows.jsonl", lambda p: write_rows(ALPACA_ROWS, p),
     {"column_map": {"input": "context"}},
     r"rows\.jsonl line 1: no column 'context' \(needed as 'input'\); available columns: instruction, input, output"),
    ("empty output", "rows.jsonl", lambda p: write_rows([ALPACA_ROWS[0], dict(ALPACA_ROWS[1], output=" ")], p),
     {}, r"rows\.jsonl line 2: column 'output' is empty text: every row needs its output$"),
    ("system_prompt not text", "rows.jsonl", lambda p: write_rows(ALPACA_ROWS, p), {"system_prompt": 5},
     r"^system_prompt must be text \(or null\), got int$"),
    ("max_seq_len 0", "rows.jsonl", lambda p: write_rows(ALPACA_ROWS, p), {"max_seq_len": 0},
     r"^max_seq_len=0: give a whole number of tokens, at least 2"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_data_is_named(tok, tmp_path, case):
    _, name, write, kwargs, message = case
    path = tmp_path / name
    write(path)
    with pytest.raises(DataError, match=message):
        instruct_dataset(tok, str(path), **kwargs)


def test_bad_chat_messages_are_named(tok, tmp_path):
    path = write_rows([{"messages": [{"role": "user", "content": "hi"}, {"role": "function", "content": "x"}]}],
                      tmp_path / "chat.jsonl")
    with pytest.raises(DataError, match=r"chat\.jsonl line 1: messages\[1\]: role 'function' is not one of"):
        chat_dataset(tok, str(path))
    # a role or from that is not text (a list): a TypeError traceback before
    for message, match in (({"role": ["user"], "content": "hi"}, r"messages\[0\]: role \['user'\] is not one of"),
                           ({"from": ["human"], "value": "hi"}, r"messages\[0\]: from=\['human'\] is not one of")):
        path = write_rows([{"messages": [message, {"role": "assistant", "content": "x"}]}], tmp_path / "role.jsonl")
        with pytest.raises(DataError, match=r"role\.jsonl line 1: " + match):
            chat_dataset(tok, str(path))
    # an empty reply trained only its end-of-turn token: the model learnt to answer nothing
    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = write_rows([{"messages": hello}, {"messages": [*hello, {"role": "user", "content": "and?"},
                                                          {"role": "assistant", "content": " "}]}],
                      tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl line 2: column 'messages': assistant reply 2 of 2 is empty"):
        chat_dataset(tok, str(path))
    # system / tools mapped to a column the data lacks: the row's own were dropped without a word
    path = write_rows([{"messages": hello, "system": "Be brief."}], tmp_path / "mapped.jsonl")
    for column_map, name in (({"system": "sys_prompt"}, "system"), ({"tools": "functions"}, "tools")):
        with pytest.raises(DataError, match=rf"mapped\.jsonl line 1: no column '{column_map[name]}' \(needed as "
                                            rf"'{name}'\); available columns: messages, system"):
            chat_dataset(tok, str(path), column_map=column_map)
    path = write_rows([{"dialog": []}], tmp_path / "other.jsonl")
    with pytest.raises(DataError, match=r"no column 'messages'.*available columns: dialog"):
        chat_dataset(tok, str(path))


def test_missing_file_and_unknown_suffix(tok, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        instruct_dataset(tok, str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(DataError, match=r"x\.xml: unknown file type '\.xml'"):
        instruct_dataset(tok, str(tmp_path / "x.xml"))


def test_a_split_a_local_source_does_not_have_is_refused(tok, tmp_path):
    """A local file, directory or format name is one split, "train" (as datasets.load_dataset names it); another
    split used to be ignored, training on the file all the same. With {split: files} the split picks the files."""
    train = str(write_rows(ALPACA_ROWS[:2], tmp_path / "train.jsonl"))
    held_out = str(write_rows(ALPACA_ROWS[2:], tmp_path / "val.jsonl"))
    for kwargs in (dict(source=train), dict(source="json", data_files=train), dict(source=str(tmp_path))):
        with pytest.raises(DataError, match=r"^split='validation': source='.*' is read as one split, 'train'; to "
                                            r"keep splits in files of their own, give data_files=\{train: \.\.\., "
                                            r"validation: \.\.\.\}$"):
            instruct_dataset(tok, split="validation", **kwargs)
    split_files = {"train": train, "validation": held_out}
    assert len(instruct_dataset(tok, "json", data_files=split_files, split="validation")) == len(ALPACA_ROWS) - 2
    assert len(instruct_dataset(tok, train, split="train")) == 2


def test_config_node_arguments(tok, tmp_path):
    """A builder called with OmegaConf nodes, as instantiate(cfg.dataset, tokenizer=tok) does."""
    from omegaconf import OmegaConf

    path = write_rows([{"q": r["instruction"], "a": r["output"]} for r in ALPACA_ROWS], tmp_path / "qa.jsonl")
    cfg = OmegaConf.create({"source": "json", "data_files": {"train": [str(path)]},
                            "column_map": {"instruction": "q", "output": "a"}})
    ds = instruct_dataset(tok, cfg.source, data_files=cfg.data_files, column_map=cfg.column_map)
    plain = instruct_dataset(tok, str(path), column_map={"instruction": "q", "output": "a"})
    assert len(ds) == len(ALPACA_ROWS) and ds[0] == plain[0]
