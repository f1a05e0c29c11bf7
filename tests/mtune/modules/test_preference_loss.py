"""Preference losses: per-sequence log-probs equal transformers' on the shipped tiny checkpoint; DPO, IPO and SimPO
equal their formulas computed independently (Python floats); the objective averages over pairs and reports the
rewards; packed pairs give the unpacked log-probs and losses; disabling adapters gives the base model exactly."""

import math

import pytest
import torch

from mtune.assets import tiny_data_dir, tiny_model_dir
from mtune.data import build_dataloader, preference_dataset
from mtune.models import build_model
from mtune.modules.lora import adapters_disabled, apply_lora
from mtune.modules.preference_loss import (
    DPOLoss,
    IPOLoss,
    PreferenceObjective,
    SimPOLoss,
    pair_logps,
    sequence_logps,
)
from mtune.tokenizers import load_tokenizer


@pytest.fixture(scope="module")
def pair_batch():
    tok = load_tokenizer(tiny_model_dir(), max_seq_len=64)
    pairs = preference_dataset(tok, str(tiny_data_dir() / "preference_eval.jsonl"))
    return next(iter(build_dataloader(pairs, 4, seed=0, shuffle=False)))


def test_sequence_logps_equal_transformers_on_the_tiny_checkpoint(pair_batch):
    from transformers import AutoModelForCausalLM

    from mtune.training.checkpointing.hf import load_model_from_hf

    tokens, labels = pair_batch["tokens"], pair_batch["labels"]
    assert tokens.shape[0] == 8 and (labels[:, -1] == -100).all()
    assert len({int(n) for n in (tokens != 0).sum(1)}) > 1 or (labels == -100).any()  # prompts / padding masked
    ours = load_model_from_hf(tiny_model_dir(), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        logps, counts = sequence_logps(ours(tokens), labels)
        hf_logits = theirs(tokens).logits.log_softmax(-1)
    expected = []
    for row in range(tokens.shape[0]):  # by hand: the labelled positions of each row, one by one
        expected.append(sum(float(hf_logits[row, i, int(labels[row, i])]) for i in range(tokens.shape[1])
                            if labels[row, i] != -100))
    torch.testing.assert_close(logps, torch.tensor(expected), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == (labels != -100).sum(1).tolist() and (counts > 0).all()
    assert (counts < (labels.shape[1])).all()  # only the responses: the prompts are not counted


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_losses_equal_their_formulas():
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(5, generator=gen, dtype=torch.float64) * 4 - 10 for _ in range(4))
    nc, nr = torch.tensor([3, 4, 5, 6, 7]), torch.tensor([7, 2, 5, 4, 3])
    for beta, eps in ((0.1, 0.0), (0.5, 0.2)):
        out = DPOLoss(beta, eps)(pc, pr, rc, rr)
        for i in range(5):
            h = (float(pc[i]) - float(pr[i])) - (float(rc[i]) - float(rr[i]))
            want = -(1 - eps) * math.log(_sig(beta * h)) - eps * math.log(_sig(-beta * h))
            assert float(out.losses[i]) == pytest.approx(want, rel=1e-12)
            assert float(out.chosen_rewards[i]) == pytest.approx(beta * (float(pc[i]) - float(rc[i])), rel=1e-12)
            assert float(out.rejected_rewards[i]) == pytest.approx(beta * (float(pr[i]) - float(rr[i])), rel=1e-12)
    out = IPOLoss(0.25)(pc, pr, rc, rr)
    for i in range(5):
        h = (float(pc[i]) - float(pr[i])) - (float(rc[i]) - float(rr[i]))
        assert float(out.losses[i]) == pytest.approx((h - 1 / (2 * 0.25)) ** 2, rel=1e-12)
    out = SimPOLoss(beta=2.0, gamma=0.5, label_smoothing=0.1)(pc, pr, None, None, nc, nr)
    for i in range(5):
        z = 2.0 * float(pc[i]) / int(nc[i]) - 2.0 * float(pr[i]) / int(nr[i]) - 0.5
        want = -0.9 * math.log(_sig(z)) - 0.1 * math.log(_sig(-z))
        assert float(out.losses[i]) == pytest.approx(want, rel=1e-12)
        assert float(out.chosen_rewards[i]) == pytest.approx(2.0 * float(pc[i]) / int(nc[i]), rel=1e-12)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="beta > 0"):
        DPOLoss(beta=0)
    with pytest.raises(ValueError, match="label_smoothing < 0.5"):
        DPOLoss(label_smoothing=0.5)
    with pytest.raises(ValueError, match="needs a reference model"):
        PreferenceObjective(DPOLoss(), None)
    PreferenceObjective(SimPOLoss(), None)  # reference-free


def test_objective_averages_over_pairs_and_reports_rewards(pair_batch):
    from mtune.training.checkpointing.hf import load_model_from_hf

    model, batch = load_model_from_hf(tiny_model_dir(), dtype=torch.float32), pair_batch
    ref = (torch.tensor([-30.0, -20.0, -25.0, -10.0]), torch.tensor([-28.0, -24.0, -25.0, -12.0]))
    objective = PreferenceObjective(DPOLoss(beta=0.2), lambda b: ref)
    summed, pairs = objective.forward_batch(model, batch)
    with torch.no_grad():
        logps, _ = sequence_logps(model(batch["tokens"]), batch["labels"])
    h = (logps[:4] - logps[4:]) - (ref[0] - ref[1])
    assert float(pairs) == 4
    torch.testing.assert_close(summed, -torch.nn.functional.logsigmoid(0.2 * h).sum())
    metrics = objective.take_metrics()
    chosen, rejected = 0.2 * (logps[:4] - ref[0]), 0.2 * (logps[4:] - ref[1])
    assert metrics["rewards/chosen"] == pytest.approx(float(chosen.mean()), rel=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(float(rejected.mean()), rel=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(float((chosen - rejected).mean()), rel=1e-5, abs=1e-6)
    assert metrics["rewards/accuracies"] == float((chosen > rejected).float().mean())
    assert metrics["logps/chosen"] == pytest.approx(float(logps[:4].mean()), rel=1e-6)
    assert objective.take_metrics() == {}  # taken once
    summed.backward()  # gradients reach the policy
    assert model.layers[0].self_attn.q_proj.weight.grad is not None


def test_adapters_disabled_is_the_base_model():
    torch.manual_seed(0)
    base = build_model("llama3_1", "tiny", device="cpu")
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = base(tokens)
    for use_dora in (False, True):
        model = build_model("llama3_1", "tiny", device="cpu")
        model.load_state_dict(base.state_dict())
        apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, dropout=0.1, use_dora=use_dora)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0, 0.5)
            adapted = model(tokens)
            with adapters_disabled(model):
                off = model(tokens)
        assert torch.equal(off, want)  # dropout on, adapters off: the base model exactly
        assert not torch.allclose(adapted, want, atol=1e-3)
        model.eval()
        with torch.no_grad():
            assert not torch.allclose(model(tokens), want, atol=1e-3)  # adapters back on after the block


def test_packed_pairs_give_the_unpacked_log_probs_and_losses():
    """Oracle: the same pairs unpacked (a row per response). Per-sequence log-probs of packed rows equal theirs
    (fp32, 1e-5), so do the label counts and the DPO loss summed over the pairs. Mutations seen failing: every
    response of a row made one document (a response then attends to the ones before it), and the rejected offset
    (``n``) left out of ``sequence_ids``."""
    from mtune.training.checkpointing.hf import load_model_from_hf

    tok = load_tokenizer(tiny_model_dir(), max_seq_len=64)
    source = str(tiny_data_dir() / "preference_eval.jsonl")
    pairs, packed = preference_dataset(tok, source), preference_dataset(tok, source, packed=True)
    rows = [packed[0], packed[1]]
    assert packed.row_len == 128 and len(packed) < len(pairs) and all(len(row["pairs"]) > 1 for row in rows)
    batch = packed.collate_fn(rows)
    n = len(batch["pair_index"])
    unpacked = pairs.collate_fn([pairs[int(i)] for i in batch["pair_index"]])
    assert batch["tokens"].shape[0] == 2 and unpacked["tokens"].shape[0] == 2 * n
    model = load_model_from_hf(tiny_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        want, want_counts = pair_logps(model(unpacked["tokens"]), unpacked)
        got, got_counts = pair_logps(model(batch["tokens"], input_pos=batch["input_pos"],
                                           document_ids=batch["document_ids"]), batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_counts.tolist() == want_counts.tolist() and int(batch["num_tokens"]) == int(unpacked["num_tokens"])
    gen = torch.Generator().manual_seed(0)
    ref = (torch.randn(n, generator=gen) - 20, torch.randn(n, generator=gen) - 20)
    objective = PreferenceObjective(DPOLoss(beta=0.5), lambda b: ref)
    assert objective.count(batch) == objective.count(unpacked) == n
    with torch.no_grad():
        torch.testing.assert_close(objective.forward_batch(model, batch)[0],
                                   objective.forward_batch(model, unpacked)[0], rtol=1e-5, atol=1e-5)


def test_packed_pairs_hand_both_models_their_longest_document():
    """The policy's forward and the reference model's both get the collator's ``longest_document``, the varlen
    kernel's bound (without it each would size the kernel by the row)."""
    from mtune.training.checkpointing.hf import load_model_from_hf
    from mtune.training.reference import ModelReference

    tok = load_tokenizer(tiny_model_dir(), max_seq_len=64)
    packed = preference_dataset(tok, str(tiny_data_dir() / "preference_eval.jsonl"), packed=True)
    batch = packed.collate_fn([packed[0], packed[1]])
    model = load_model_from_hf(tiny_model_dir(), dtype=torch.float32).eval()
    seen = []

    def recording(module, args, kwargs):
        seen.append(kwargs.get("longest_document"))

    model.register_forward_pre_hook(recording, with_kwargs=True)
    with torch.no_grad():
        PreferenceObjective(DPOLoss(beta=0.5), ModelReference(model)).forward_batch(model, batch)
    assert 1 < batch["longest_document"] < batch["tokens"].shape[1] and seen == [batch["longest_document"]] * 2


class _FixedLogits(torch.nn.Module):
    """A stand-in policy whose logits are given: the objective's arithmetic alone is under test."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, tokens, input_pos=None, document_ids=None, longest_document=None):
        return self.logits


def test_simpo_objective_normalises_each_response_by_its_own_length_and_accumulates_metrics():
    """Oracle: log-probs summed token by token in fp64 here. SimPO through the objective divides each response by
    its own labelled-token count (chosen and rejected lengths differ), and the metrics are means over the pairs of
    every micro-batch since the last take, logps/rejected included."""
    gen = torch.Generator().manual_seed(0)
    objective = PreferenceObjective(SimPOLoss(beta=2.0, gamma=0.5), None)
    seen = {name: [] for name in ("chosen", "rejected", "logps_c", "logps_r")}
    for _ in range(2):  # two micro-batches of 2 pairs: rows 0-1 chosen, 2-3 rejected
        labels = torch.randint(0, 11, (4, 9), generator=gen)
        labels[:, :2] = -100  # prompts
        labels[0, 7:], labels[3, 4:] = -100, -100  # padding: 5, 7 chosen and 7, 2 rejected tokens
        logits = torch.randn(4, 9, 11, generator=gen) * 2
        summed, n = objective.forward_batch(_FixedLogits(logits), {"tokens": torch.zeros(4, 9, dtype=torch.long),
                                                                   "labels": labels})
        log_probs = logits.double().log_softmax(-1)
        sums = [sum(float(log_probs[r, i, labels[r, i]]) for i in range(9) if labels[r, i] != -100) for r in range(4)]
        counts = [int((labels[r] != -100).sum()) for r in range(4)]
        assert counts == [5, 7, 7, 2]
        want = 0.0
        for i in range(2):
            chosen, rejected = 2.0 * sums[i] / counts[i], 2.0 * sums[2 + i] / counts[2 + i]
            want -= math.log(_sig(chosen - rejected - 0.5))
            for name, value in zip(seen, (chosen, rejected, sums[i], sums[2 + i])):
                seen[name].append(value)
        assert float(n) == 2 and float(summed) == pytest.approx(want, rel=1e-5)
    metrics = objective.take_metrics()
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert metrics["rewards/chosen"] == pytest.approx(mean(seen["chosen"]), rel=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(mean(seen["rejected"]), rel=1e-5)
    margins = [c - r for c, r in zip(seen["chosen"], seen["rejected"])]
    assert metrics["rewards/margins"] == pytest.approx(mean(margins), rel=1e-5)
    assert metrics["rewards/accuracies"] == mean([float(m > 0) for m in margins])
    assert metrics["logps/chosen"] == pytest.approx(mean(seen["logps_c"]), rel=1e-5)
    assert metrics["logps/rejected"] == pytest.approx(mean(seen["logps_r"]), rel=1e-5)


def test_simpo_response_without_labelled_tokens_scores_zero():
    """A response truncated to no labelled tokens has log-prob 0 and reward 0, not 0/0 (NaN)."""
    out = SimPOLoss(beta=2.0, gamma=0.5)(torch.tensor([0.0, -6.0]), torch.tensor([-4.0, 0.0]), None, None,
                                         torch.tensor([0, 3]), torch.tensor([2, 0]))
    assert out.chosen_rewards.tolist() == [0.0, -4.0] and out.rejected_rewards.tolist() == [-4.0, 0.0]
    assert out.losses.tolist() == pytest.approx([-math.log(_sig(4.0 - 0.5)), -math.log(_sig(-4.0 - 0.5))], rel=1e-6)


@pytest.mark.parametrize("make", [lambda: IPOLoss(beta=0), lambda: SimPOLoss(beta=0),
                                  lambda: SimPOLoss(label_smoothing=0.5)])
def test_ipo_and_simpo_refuse_bad_settings(make):
    with pytest.raises(ValueError, match="beta > 0"):
        make()
