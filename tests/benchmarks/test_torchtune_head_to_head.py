"""benchmarks/torchtune_head_to_head.py's parity: rows both libraries see whole, one to a packed row, trained a few
times, and mtune's first-step loss on them against transformers' on the same checkpoint. torchtune is not installed
here: its side runs on the GPU machine (gpu_suite's head-to-head) and by hand (docs/benchmarks.md)."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests._helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


h2h = load_script("torchtune_head_to_head", "benchmarks")


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """The harness module and its fixture (model, tokenizer, data), written once."""
    return h2h, h2h.write_fixture(tmp_path_factory.mktemp("h2h") / "fixture")


def test_parity_rows_fill_one_step_and_mtunes_first_loss_is_the_checkpoints(tmp_path, fixture):
    """Mutations seen failing: mtune's parity rows without their EOS (``add_eos: false``: the oracle's loss then
    differs); the fixture's model written with Llama 3.1's RoPE scaling, which torchtune's llama3 builder lacks
    (transformers reads the scaling too, so the loss still agrees: the config is checked directly)."""
    from transformers import AutoModelForCausalLM

    from mtune.tokenizers import load_tokenizer

    h2h, paths = fixture
    assert json.loads((paths["model"] / "config.json").read_text())["rope_scaling"] is None
    batch, seq = 2, 128
    data = h2h.write_parity_data(paths, batch, seq)
    tokenizer = load_tokenizer(paths["model"])
    rows = [tokenizer.encode(json.loads(line)["text"], add_bos=True, add_eos=True)
            for line in data.read_text().splitlines()]
    assert len(rows) == batch and {len(r) for r in rows} == {seq - 1}

    args = SimpleNamespace(work=tmp_path / "work", steps=1, batch=batch, seq=seq, device="cpu", peaks={"fp32": 1e11},
                           venv=tmp_path, torchtune_python=sys.executable, torchtune_path=None, profile=False)
    record = h2h.first_step_parity(paths, "fp32", args)
    losses = record["mtune_losses"]  # the one batch, trained PARITY_STEPS times: each step lowers its loss
    assert len(losses) == h2h.PARITY_STEPS and all(b < a for a, b in zip(losses, losses[1:])), losses
    if importlib.util.find_spec("torchtune") is None:  # CI: torchtune is not a dependency
        assert "error" in record["torchtune"] and "torchtune_losses" not in record
    else:  # a machine with torchtune beside mtune: its side too, every step
        assert record["torchtune_losses"] == pytest.approx(losses, rel=1e-5)

    # oracle: transformers on the fixture's checkpoint, each row alone, every token after the first predicted
    model = AutoModelForCausalLM.from_pretrained(paths["model"], torch_dtype=torch.float32)
    ids = torch.tensor(rows)
    with torch.no_grad():
        logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert record["mtune"] == pytest.approx(expected.item(), rel=1e-5)


def test_profile_takes_the_last_step_of_a_run(tmp_path, fixture):
    """``--profile``: the run's last step profiled (past mtune's tracked first steps: no dispatch-mode frames), its
    costliest ops by their own time, the costliest first."""
    h2h, paths = fixture
    args = SimpleNamespace(work=tmp_path / "work", steps=5, warmup=1, batch=2, seq=128, device="cpu",
                           peaks={"fp32": 1e11}, venv=tmp_path, torchtune_python=None, torchtune_path=None,
                           profile=True)
    run = h2h.run_one("mtune", paths, "lora", False, "fp32", args, 0)
    top = run["profile_top_cpu"]
    spent = [float(entry.rsplit(": ", 1)[1].split(" ms")[0]) for entry in top]
    assert len(top) == 12 and spent == sorted(spent, reverse=True) and top[0].startswith("aten::mm")
    assert not any("PythonDispatchMode" in entry for entry in top)  # not one of the byte tracker's steps
    assert "profile_top_device" not in run and len(run["losses"]) == 5


def test_fixture_documents_counts_every_row_as_mtune_tokenizes_it(fixture):
    """``--fixture-documents``: every instruct row, its tokens as mtune's instruct_dataset makes them."""
    from mtune.data import instruct_dataset
    from mtune.tokenizers import load_tokenizer

    h2h, paths = fixture
    stats = h2h.fixture_documents(paths, 2048)
    rows = instruct_dataset(load_tokenizer(paths["model"]), str(paths["data"]), packed=False, cache=False)
    lengths = [len(rows[i]["tokens"]) for i in range(len(rows))]
    assert stats["rows"] == len(paths["data"].read_text().splitlines()) == len(lengths)
    assert stats["mean_tokens"] == pytest.approx(sum(lengths) / len(lengths)) and stats["max_tokens"] == max(lengths)
    assert stats["documents_per_row"] == pytest.approx(2048 * len(lengths) / sum(lengths))
