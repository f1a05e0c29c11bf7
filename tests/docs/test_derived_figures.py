"""The derived results files are what `benchmarks/derived_figures.py` writes from the committed results, and its
ratios are the quotients of the numbers they come from (mutation seen failing: eager_to_compiled dividing the
eager tokens/s by the compiled ones)."""

import json
from pathlib import Path

import pytest

from tests._helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


derived = load_script("derived_figures", "benchmarks")


def test_committed_derived_files_are_the_scripts_output(tmp_path):
    derived.main(tmp_path)
    for name in ("derived_head_to_head.json", "derived_memory_techniques.json", "derived_plan.json",
                 "derived_gpu_suite.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((RESULTS / name).read_text()), name


def test_eager_to_compiled_ratio_from_the_two_runs():
    # independent read of the two runs' summaries: full fp32, compiled tokens/s over the fifth run's eager ones
    def tok_s(run, compiled):
        rows = json.loads((RESULTS / run / "torchtune_head_to_head.json").read_text())["summary"]
        (row,) = [r for r in rows if (r["case"], r["dtype"], bool(r["compile"])) == ("full", "fp32", compiled)]
        return row["mtune"]["tokens_per_second"]

    records = derived.eager_to_compiled()
    (full_fp32,) = [r for r in records if (r["case"], r["dtype"], r["runs"]) == ("full", "fp32",
                                                                                 "h2h_fused_loss -> h2h_compile")]
    assert full_fp32["speedup"] == tok_s("h2h_compile", True) / tok_s("h2h_fused_loss", False)
    memory = json.loads((RESULTS / "memory_techniques.json").read_text())["rows"]
    state = {r["name"]: r["optimizer_state"] for r in memory}
    (row,) = [r for r in derived.optimizer_state_vs_adamw() if r["name"] == "torchao AdamW4bit"]
    assert row["optimizer_state_ratio"] == state["torchao AdamW4bit"] / state["full fp32, AdamW (baseline)"]


def test_gpu_suite_pairs_and_margins_from_the_rows():
    # independent read of gpu_suite.json: 8B QLoRA eager over 8B LoRA eager within the last lease that ran both (the
    # QLoRA row of that lease, not a later lease's), then over each case's latest row (QLoRA was measured again),
    # and the 8B full compiled row's margin
    import datetime

    all_ok = [r for r in json.loads((RESULTS / "gpu_suite.json").read_text())["rows"] if r["status"] == "ok"]
    rows = {r["case"]: r for r in all_ok}
    figures = derived.gpu_suite_figures()
    pair, newest = [p for p in figures["tokens_per_s_pairs"]
                    if p["name"] == "llama3_1_8B_qlora_eager_packed4096 / llama3_1_8B_lora_eager_packed4096"]
    lora = rows["llama3_1_8B_lora_eager_packed4096"]
    lora_date = datetime.datetime.fromisoformat(lora["date"])
    (qlora,) = [r for r in all_ok if r["case"] == "llama3_1_8B_qlora_eager_packed4096"
                and abs(datetime.datetime.fromisoformat(r["date"]) - lora_date) < datetime.timedelta(minutes=30)]
    assert qlora is not rows["llama3_1_8B_qlora_eager_packed4096"]  # a later lease measured QLoRA alone
    assert pair["ratio"] == qlora["tokens_per_s"] / lora["tokens_per_s"]
    assert pair["leases"] == [lora["date"]] and pair["basis"] == "one lease"
    assert newest["ratio"] == rows["llama3_1_8B_qlora_eager_packed4096"]["tokens_per_s"] / lora["tokens_per_s"]
    assert newest["basis"] == "each case's latest row" and len(newest["leases"]) == 2
    full = rows["llama3_1_8B_full_compiled"]
    (margin,) = [m for m in figures["allocator_margins"] if m["name"] == "llama3_1_8B_full_compiled"]
    assert margin["reserved_minus_allocated_gib"] == full["max_reserved_gib"] - full["max_allocated_gib"]


def test_compile_pays_back_when_both_runs_have_taken_the_same_time():
    # independent form: after `pays_back_after_steps` steps (the measured ones, then steps at the median timed step),
    # the compiled run and its eager twin have taken the same wall time; the 8B LoRA pair of the first lease
    rows = [r for r in json.loads((RESULTS / "gpu_suite.json").read_text())["rows"] if r["status"] == "ok"]
    lease_of = derived._leases(rows)
    (pair,) = [p for p in derived.gpu_suite_figures()["tokens_per_s_pairs"]
               if p["name"] == "llama3_1_8B_lora_compiled_packed4096 / llama3_1_8B_lora_eager_packed4096"]
    compiled, eager = ([r for r in rows if r["case"] == case and lease_of[r["date"]] in pair["leases"]][-1]
                       for case in pair["name"].split(" / "))

    def wall(row, steps):
        return sum(row["step_times_s"]) + (steps - len(row["step_times_s"])) * row["step_s"]

    steps = pair["pays_back_after_steps"]
    assert 10 < steps < 1000 and wall(compiled, steps) == pytest.approx(wall(eager, steps), rel=1e-12)
    assert wall(compiled, steps + 1) < wall(eager, steps + 1)


def test_paged_states_are_the_cards_use_less_the_allocator_and_the_context():
    # independent read: the context as the median of used - reserved over each case's latest row that plans nothing
    # off the allocator
    import statistics

    rows = [r for r in json.loads((RESULTS / "gpu_suite.json").read_text())["rows"]
            if r["status"] == "ok" and r.get("kind") == "run"]
    latest = {r["case"]: r for r in rows}.values()  # one GPU model so far
    context = statistics.median(r["device_used_gib"] - r["max_reserved_gib"] for r in latest
                                if not r["planned_host_gib"])
    (paged,) = [r for r in rows if r["case"] == "llama3_1_8B_full_paged_adamw8bit"]
    figures = derived.gpu_suite_figures()
    (record,) = [m for m in figures["paged_states"] if m["name"] == "llama3_1_8B_full_paged_adamw8bit"]
    assert figures["cuda_context_gib"] == context
    assert record["measured_managed_gib"] == paged["device_used_gib"] - paged["max_reserved_gib"] - context
    assert record["plan_error"] == paged["planned_host_gib"] / record["measured_managed_gib"] - 1


def test_nf4_block_time_is_the_blocks_seven_matmuls():
    # independent read of nf4_matmul.json: q, k, v, o, gate, up, down of one 8B block, bitsandbytes over bf16
    rows = json.loads((RESULTS / "nf4_matmul.json").read_text())["rows"]

    def block(variant):
        seconds = {r["shape"]: r["seconds"] for r in rows if r["variant"] == variant}
        return (2 * seconds["q_proj/o_proj"] + 2 * seconds["k_proj/v_proj"] + 2 * seconds["gate_proj/up_proj"]
                + seconds["down_proj"])

    (bnb,) = [r for r in derived.nf4_block_figures() if r["name"] == "bitsandbytes matmul_4bit"]
    assert bnb["block_seconds"] == pytest.approx(block("bitsandbytes matmul_4bit"), rel=1e-12)
    assert bnb["over_bf16"] == pytest.approx(block("bitsandbytes matmul_4bit") / block("bf16 (dequantized once)"),
                                             rel=1e-12)


def test_nf4_pairs_measured_before_the_kernel_compiled_in_steps_say_so():
    # every NF4 twin pair so far comes from leases before the fix (the kernel ran uncompiled): each carries the caveat;
    # no other pair does
    figures = derived.gpu_suite_figures()
    for pair in figures["tokens_per_s_pairs"]:
        measured_before = all(lease < "2026-11-26T19:30:55+00:00" for lease in pair["leases"])
        assert ("caveat" in pair) == (pair["what"].startswith("NF4 kernel") and measured_before), pair["name"]


def test_the_planners_cuda_context_is_the_measured_one():
    """``CUDA_CONTEXT_BYTES`` is the GPU suite's median context (what the card held beyond the caching allocator on
    rows that keep nothing else outside it), rounded up to a MiB: a lease that moves the median moves the constant,
    and the config headers are rendered again from it (scripts/render_plan_figures.py)."""
    import math

    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES

    measured_gib = json.loads((RESULTS / "derived_gpu_suite.json").read_text())["cuda_context_gib"]
    assert CUDA_CONTEXT_BYTES == math.ceil(measured_gib * 1024) * 2**20, (CUDA_CONTEXT_BYTES, measured_gib)


def test_held_runs_set_each_part_16_row_beside_its_prediction_and_the_model_on_its_history():
    gpu = "NVIDIA H100 80GB HBM3"
    row = lambda case, status, **figures: {"case": case, "gpu_name": gpu, "status": status, **figures}
    rows = [row("a_held_to_fit_margin", "failed"),  # a failure that is not the allocator's: not a held run
            row("a_held_to_fit_margin", "ok", held_to_gib=18.0, max_reserved_gib=17.5, trace_max_reserved_gib=17.5,
                model_max_reserved_gib=17.5, model_refused_request=None, trace_out_of_memory=False),
            row("b_held_to_fit_margin", "out_of_memory", held_to_gib=10.8, trace_max_reserved_gib=10.7,
                model_max_reserved_gib=10.1, model_refused_request=None, trace_out_of_memory=True),
            row("c", "ok")]  # not a held run
    predictions = [{"case": "a", "fit_spare_after_run_gib": 0.3}, {"case": "b", "fit_spare_after_run_gib": -0.8}]
    a, b = derived.held_runs(rows, predictions)
    assert (a["name"], a["served"], a["prediction_held"], a["model_on_trace_agrees"]) == (
        "a_held_to_fit_margin", True, True, True)
    # refused as predicted, but the model on the run's own history served the request the allocator refused
    assert (b["served"], b["prediction_held"], b["predicted_spare_gib"]) == (False, True, -0.8)
    assert (b["model_on_trace_refused"], b["model_on_trace_agrees"]) == (False, False)


def test_mfu_by_documents_counts_each_of_a_rows_two_documents_against_itself():
    """Oracle: mtune's FLOPs count of the 8B LoRA config (a meta model, the config's adapters) at the documents'
    attention length, half the 4096-token row, times the row's tokens/s over its peak; the dense mask's row keeps
    the whole row (so does mtune's count), and a row that says its ``attention_len`` keeps its own MFU. Mutation seen
    failing: the correction applied to the dense mask's rows."""
    import torch
    from omegaconf import OmegaConf

    from mtune.models import build_model
    from mtune.modules.lora import apply_lora
    from mtune.training.observe.flops import flops_per_token

    rows = [r for r in json.loads((RESULTS / "gpu_suite.json").read_text())["rows"] if r["status"] == "ok"]
    lora = next(r for r in rows if r["case"] == "llama3_1_8B_lora_compiled_packed4096")
    dense = next(r for r in rows if r["case"] == "llama3_1_8B_lora_compiled_dense_mask")
    by_row = {(r["case"], r["date"]): r for r in derived.mfu_by_documents(rows)}
    adapters = OmegaConf.load(REPO / "recipes/configs/llama3_1/8B_lora_single_device.yaml").lora
    with torch.device("meta"):
        model = apply_lora(build_model("llama3_1", "8B", device="meta"), list(adapters.modules), rank=adapters.rank,
                           alpha=adapters.alpha)
    per_token = flops_per_token(model, 4096, None, tokens=lora["tokens_per_step"], attention_len=2048).model
    assert by_row[lora["case"], lora["date"]]["mfu"] == pytest.approx(
        per_token * lora["tokens_per_s"] / lora["peak_flops"], rel=1e-12)
    assert by_row[lora["case"], lora["date"]]["attention_len"] == 2048
    assert by_row[dense["case"], dense["date"]]["mfu"] == dense["mfu"]
    counted = {**lora, "attention_len": 2048.0, "date": "later"}
    assert derived.mfu_by_documents([counted])[0]["mfu"] == lora["mfu"]
