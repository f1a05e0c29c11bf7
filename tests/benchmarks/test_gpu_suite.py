"""benchmarks/gpu_suite.py's dry run on a CPU: the rows a GPU run would write, their schema, the plan against the
tracker, and the markdown table beside the JSON."""

import json
import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests._helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
suite = load_script("gpu_suite", "benchmarks")
margin_script = load_script("allocator_margin", "benchmarks")

ROW_KEYS = {"case", "part", "kind", "compile", "status", "gpu_name", "python", "torch", "cuda", "driver", "torchao",
            "bitsandbytes", "expandable_segments", "tokens_per_s", "mfu", "hfu", "planned_allocated_gib",
            "max_allocated_gib", "max_reserved_gib", "attention_kernel", "date"}
# one case per machinery: LoRA, QLoRA (NF4), the low-memory full fine-tune (paged bitsandbytes AdamW8bit in
# backward), activation offloading, packed rows by the segments kernel; compile is left to the CLI dry run (minutes
# on 2 cores)
CASES = ["llama3_1_8B_full_low_memory", "llama3_2_1B_lora_eager", "llama3_1_8B_qlora_eager_packed4096",
         "llama3_1_8B_lora_activation_offloading", "llama3_1_8B_lora_packed4096_segments"]  # in the suite's order


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_suite")
    patch = pytest.MonkeyPatch()
    patch.setenv("MTUNE_PEAK_FLOPS", "1e11")  # mfu against a given peak: no bf16 matmul peak measured on the CPU
    out = tmp / "gpu_suite.json"
    rows = suite.main(["--dry-run", "--in-process", "--no-compile", "--raise-errors", "--out", str(out),
                       "--work", str(tmp / "work"), "--cases", *CASES])
    patch.undo()
    return out, rows


def test_every_case_is_data_with_a_known_kind_and_parts_fit_their_budget():
    names = [c.name for c in suite.CASES]
    assert len(names) == len(set(names))
    assert {c.kind for c in suite.CASES} <= {"run", "head_to_head", "fit", "longest_context", "oom_recovery",
                                             "preference"}
    for part in {c.part for c in suite.CASES}:
        minutes = sum(c.minutes for c in suite.CASES if c.part == part and not c.pending)
        assert minutes <= 8, (part, minutes)
    first = {c.name for c in suite.CASES if c.part in (1, 2)}  # the part 1
    assert {"llama3_2_1B_lora_compiled", "llama3_1_8B_lora_compiled_packed4096",
            "llama3_1_8B_qlora_compiled_packed4096", "llama3_1_8B_full_low_memory",
            "llama3_2_3B_lora_head_to_head"} == first


def test_dry_run_rows_have_the_schema_and_cuda_figures_are_null(dry_run):
    out, rows = dry_run
    assert [r["case"] for r in rows] == CASES
    written = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in written] == CASES
    for row in rows:
        assert row["status"] == "ok", row
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["dry_run"] and row["gpu_name"] is None
        assert row["max_allocated_gib"] is None and row["max_reserved_gib"] is None
        assert row["modelled_margin_gib"] is None and row["modelled_held_margin_gib"] is None  # no allocator
        assert row["alloc_retries"] is None and row["syncs_all_streams"] is None and row["segments_expandable"] is None
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] <= row["hfu"]
        assert row["batch_size"] == 2 and row["seq_len"] == 64
        assert row["attention_kernel"]  # named from the profiler (the CPU's SDPA kernel)
        top = row["profile_top_cpu"]  # the profiled step's costliest ops, the costliest first; no device list on a CPU
        assert len(top) == 12 and "profile_top_device" not in row
        spent = [float(entry.rsplit(": ", 1)[1].split(" ms")[0]) for entry in top]
        assert spent == sorted(spent, reverse=True) and spent[0] > 0
        assert not any(".py(" in entry for entry in top)  # ops only: the Python frames the stacks add are not ops
        sites = row["profile_top_sites"]  # the same time by the mtune function the ops ran in
        assert sites and all(s.startswith(("mtune/", "(outside mtune)")) for s in sites)
        assert any(s.startswith("mtune/modules/") and ".py(" in s for s in sites)
        assert len(row["losses"]) == row["tracked_steps"] == 3  # plan_check's 3 steps, then untracked ones
        assert row["dynamo_limits_hit"] == 0
    assert rows[0]["hfu"] > rows[0]["mfu"]  # checkpointing as shipped: recomputation counted in hfu only
    assert rows[-1]["attention_kernel"]  # packed 64-token rows under attention_kernel=segments


def test_mfu_counts_the_batch_as_a_run_does(dry_run):
    """Attention FLOPs as mtune's runs count a batch (StepFlops): the segments row's two 32-token documents each
    against itself, 12 x 32 x heads x head_dim a layer and token (the tiny Llama's 4 x 64 in 2 layers: QK^T and PV
    forward, twice that backward); the other rows' 64-token rows under the dense mask (``auto`` at 64 tokens) over
    the whole row; MFU from that count and the given peak. Mutation seen failing: the count at the row for both."""
    _, rows = dry_run
    for row in rows:
        documents = row["case"] == "llama3_1_8B_lora_packed4096_segments"
        assert row["attention_len"] == (32 if documents else 64)
        if documents:
            assert row["attention_flops_per_token"] == 12 * 32 * 4 * 64 * 2
        assert row["mfu"] == pytest.approx(row["model_flops_per_token"] * row["tokens_per_s"] / 1e11, rel=1e-12)


def test_short_document_batches_and_their_row_bound_twin():
    """Part 18's batches: 96-token documents and the row's 32-token rest; the twin without ``longest_document``, so
    the varlen call is bounded by the row."""
    import torch

    batch = suite.synthetic_batch(2, 2048, 100, torch.Generator().manual_seed(0), document_tokens=96)
    ids = batch["document_ids"][0]
    assert batch["longest_document"] == 96 and ids.max() == 21 and (ids == 21).sum() == 32
    assert batch["input_pos"][0, 95] == 95 and batch["input_pos"][0, 96] == 0
    twin = suite.synthetic_batch(2, 2048, 100, torch.Generator().manual_seed(0), 96, row_bound=True)
    assert "longest_document" not in twin and torch.equal(twin["document_ids"], batch["document_ids"])
    halves = suite.synthetic_batch(1, 64, 100, torch.Generator().manual_seed(0))
    assert halves["longest_document"] == 32 and halves["document_ids"][0].tolist() == [0] * 32 + [1] * 32


def test_a_case_in_its_own_process_reports_its_own_environment(monkeypatch, tmp_path):
    """``--one-case`` (each case's process under the suite) writes its own allocator settings into its row: the
    suite's parent, whose environment lacks part 16's and 17's allocator settings, once filled them in instead.
    Mutation seen failing: the child's environment left out of its row."""
    monkeypatch.setenv("MTUNE_PEAK_FLOPS", "1e11")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # not mtune's default: its own
    result = tmp_path / "row.json"
    suite.main(["--one-case", "llama3_2_1B_lora_eager", str(result), "--work", str(tmp_path), "--dry-run"])
    row = json.loads(result.read_text())
    assert row["status"] == "ok" and row["expandable_segments"] is False and row["gpu_name"] is None


@pytest.mark.parametrize("settings, asked", [(None, True), ("expandable_segments:False", False),
                                             ("max_split_size_mb:512", False), ("expandable_segments:True", True)])
def test_a_row_says_whether_its_run_asked_for_expandable_segments(monkeypatch, settings, asked):
    """Unset: mtune's default asks for them (mtune.training.context); set: as the user's settings say."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if settings is not None:
        monkeypatch.setenv("PYTORCH_ALLOC_CONF", settings)
    assert suite.expandable_segments_asked() is asked


def test_a_case_needing_an_undeclared_key_is_pending():
    from dataclasses import replace

    case = replace(suite.CASES[-1], needs=("a_key_no_recipe_declares",))
    assert suite.case_config(suite.mtune_api(), case, device="cpu", dry_run=True) == (None,
                                                                                    ["a_key_no_recipe_declares"])


def test_a_fit_case_runs_the_config_fit_wrote(tmp_path):
    """The fit case runs what `mtune plan --fit` answered, not its own batch again. Seen on an H100 (2026-11-26): the
    24 GiB answer (batch 1 x 4 accumulation, checkpointing every 2 blocks) was run at the case's batch 4 and ran out
    of memory under its fraction."""
    api = suite.mtune_api()
    case = next(c for c in suite.CASES if c.kind == "fit")
    fitted = tmp_path / "fitted.yaml"
    cfg, _ = suite.case_config(api, case, device="cpu", dry_run=True)
    cfg.batch_size, cfg.gradient_accumulation_steps, cfg.activation_checkpointing_every_n_layers = 1, 4, 2
    cfg.enable_activation_checkpointing = True
    fitted.write_text(OmegaConf.to_yaml(cfg))
    ran = suite.fitted_config(api, case, fitted)
    assert (ran.batch_size, ran.gradient_accumulation_steps, ran.activation_checkpointing_every_n_layers) == (1, 4, 2)
    assert case.batch_size != 1


def test_a_fit_case_asks_mtune_plan_fit_and_runs_its_answer(monkeypatch, tmp_path):
    """The fit case end to end on the CPU: `mtune plan --fit` at the dry run's budget, then its answer run. Found
    failing (2026-11-27): the budget went to the command line as bare bytes, which `--device-memory` refuses since
    it asks for a unit, so every fit row would have failed on the GPU."""
    monkeypatch.setenv("MTUNE_PEAK_FLOPS", "1e11")
    (row,) = suite.main(["--dry-run", "--in-process", "--no-compile", "--raise-errors", "--out",
                         str(tmp_path / "rows.json"), "--work", str(tmp_path / "work"), "--cases",
                         "llama3_1_8B_lora_fit_24GiB"])
    assert row["status"] == "ok", row.get("reason")
    assert row["device_memory_gib"] == suite.DRY_RUN["device_memory_gib"] and "mtune plan --fit" in row["fit_config"]


@pytest.mark.parametrize("name,family", [("qwen3_moe_30B_A3B_qlora_compiled_packed4096", "qwen3_moe"),
                                         ("qwen3_5_9B_lora_fla_packed4096", "qwen3_5"),
                                         ("gpt_oss_20B_lora_packed4096", "gpt_oss")])
def test_a_dry_run_keeps_the_cases_family_at_its_tiny_size(name, family):
    """So the CPU dry run runs a case's own layers (experts, Gated DeltaNet, sinks) before a lease does. Mutation seen
    failing: the tiny (dense Llama) family for every case."""
    case = next(c for c in suite.CASES if c.name == name)
    cfg, _ = suite.case_config(suite.mtune_api(), case, device="cpu", dry_run=True)
    assert (cfg.model.family, cfg.model.size) == (family, "tiny")


def test_plan_agrees_with_the_tracker_on_cpu(dry_run):
    _, rows = dry_run
    for row in rows:
        # the planner runs the same steps on fake tensors: on the CPU it predicts the tracker's live-byte peak
        assert row["plan_predicts"].startswith("peak_tensor_gib")
        assert abs(row["plan_vs_tracker_error"]) < 0.02, (row["case"], row["plan_vs_tracker_error"])


def test_markdown_table_is_rewritten_from_all_rows(dry_run, tmp_path):
    out, rows = dry_run
    copy = tmp_path / "gpu_suite.json"
    copy.write_text(out.read_text())
    suite.write_results(rows[:1], copy)  # appends
    assert len(json.loads(copy.read_text())["rows"]) == len(rows) + 1
    lines = copy.with_suffix(".md").read_text().splitlines()
    assert lines[1].startswith("| case | compile | gpu_name | tokens_per_s |")
    assert len(lines) == 3 + len(rows) + 1
    assert "| llama3_1_8B_lora_packed4096_segments |" in lines[-2] and lines[-2].endswith("| ok |")


def test_attention_kernel_names():
    assert suite.attention_kernel({"aten::_scaled_dot_product_flash_attention"}) == "flash"
    assert suite.attention_kernel({"aten::_scaled_dot_product_efficient_attention",
                                   "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"}) == "mem_efficient"
    assert suite.attention_kernel({"aten::_scaled_dot_product_flash_attention_for_cpu"}) == "flash_cpu"
    assert suite.attention_kernel({"triton_tem_fused_flex_attention_0"}) == "flex"
    assert suite.attention_kernel({"aten::scaled_dot_product_attention", "aten::bmm"}) == "math"
    assert suite.attention_kernel({"aten::mm"}) is None


def test_a_dry_run_must_name_its_output():
    with pytest.raises(SystemExit, match="--out"):
        suite.main(["--dry-run"])


def test_the_oom_recovery_case_runs_mtune_under_three_quarters_of_its_plan_and_finishes(tmp_path):
    """The fit issue's GPU check, dry: `mtune run` held to 75% of its planned peak re-plans once and ends all its
    steps. Mutation: the limit at 100% of the plan gives no re-plan and fails this."""
    out = tmp_path / "oom.json"
    (row,) = suite.main(["--dry-run", "--in-process", "--raise-errors", "--out", str(out), "--work",
                         str(tmp_path / "work"), "--cases", "llama3_1_8B_lora_oom_recovery"])
    assert row["status"] == "ok" and row["exit_status"] == 0, row.get("reason")
    assert row["device_memory_limit_gib"] == pytest.approx(0.75 * row["planned_allocated_gib"], rel=1e-6)
    assert len(row["replans"]) >= 1 and "running step 1 again" in row["replans"][0]
    assert row["steps_done"] == [1, 2, 3] and all(t > 0 for t in row["trained_tokens"])


def test_a_preference_case_runs_mtune_dpo_on_full_packed_rows(tmp_path):
    """Part 14's DPO rows, dry: `mtune run lora_dpo_single_device` on the tiny task's pairs packed into full rows,
    every step logged, tokens/s the median of the steps after the warm-up, the plan of the same config beside it."""
    out = tmp_path / "dpo.json"
    (row,) = suite.main(["--dry-run", "--in-process", "--raise-errors", "--out", str(out), "--work",
                         str(tmp_path / "work"), "--cases", "llama3_1_8B_lora_dpo_adapters_off"])
    assert row["status"] == "ok" and row["exit_status"] == 0, row.get("reason")
    assert row["kind"] == "preference" and row["planned_allocated_gib"] > 0
    assert len(row["losses"]) == len(row["rewards_accuracy"]) == 3  # one warm-up and two timed steps
    metrics = [json.loads(line) for line in (tmp_path / "work" / "llama3_1_8B_lora_dpo_adapters_off" /
                                              "metrics.jsonl").read_text().splitlines()]
    assert row["tokens_per_s"] == statistics.median(m["tokens_per_second"] for m in metrics[1:])
    assert row["max_allocated_gib"] is None and row["plan_error"] is None  # no CUDA allocator on a CPU


def test_dynamo_limits_hit_counts_a_function_dynamo_gave_up_on():
    """A function compiled at static shapes and called with 9 of them: dynamo gives up on the ninth (its limit is
    8) and runs it eagerly; the row's ``dynamo_limits_hit`` counts that, once."""
    import torch

    torch._dynamo.reset()
    before = suite.dynamo_limits_hit()
    double = torch.compile(lambda t: t * 2, backend="eager", dynamic=False)
    for n in range(1, 10):
        double(torch.ones(n))
    assert suite.dynamo_limits_hit() == before + 1
    torch._dynamo.reset()


def test_a_cuda_rows_modelled_margins_are_the_allocator_model_over_its_plans_events():
    mib = 2**20
    # a 12 MiB block freed, then a 14 MiB request: without a limit a second segment, 12 MiB reserved beyond the 14
    # allocated; held to 14 MiB, the freed segment is returned first, and nothing is reserved beyond them
    events = [("alloc", 1, 12 * mib, 0), ("free", 1, 0, 0), ("alloc", 2, 14 * mib, 0)]
    assert suite.modelled_margins(events, mib) == {"modelled_margin_gib": 12, "modelled_held_margin_gib": 0}


@pytest.mark.parametrize("peak_gib", [3, 16.76, 40])
def test_a_held_run_gets_what_the_tightest_budget_fit_accepts_leaves_the_allocator(peak_gib):
    from types import SimpleNamespace

    from mtune.training.planning.fit import allocator_margin
    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES
    from mtune.units import GIB

    peak = int(peak_gib * GIB)
    plan = SimpleNamespace(device_peak_bytes=peak, device_total_bytes=peak + CUDA_CONTEXT_BYTES)
    limit = suite.fit_margin_limit(SimpleNamespace(allocator_margin=allocator_margin), plan)
    budget = limit + CUDA_CONTEXT_BYTES
    # --fit accepts that budget (the plan's total and the margin within it) and not a byte less
    assert plan.device_total_bytes + allocator_margin(budget) <= budget
    assert plan.device_total_bytes + allocator_margin(budget - 1) > budget - 1
    # under 20 GiB the margin is its 1 GiB floor; over it, 5% of the budget
    assert limit - peak == (GIB if budget <= 20 * GIB else allocator_margin(budget))


def test_a_held_run_refused_is_a_row_that_says_so_and_any_other_run_refused_raises(monkeypatch, tmp_path):
    import torch

    def refused(api, case, cfg, *, workdir, memory_fraction=None, row=None):
        row["held_to_gib"] = 17.76  # what run_case measured before the allocator refused
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(suite, "run_case", refused)
    held = next(c for c in suite.CASES if c.held_to_fit_margin)
    row = suite.measure(suite.mtune_api(), held, device="cpu", dry_run=True, workdir=tmp_path, args=None)
    assert row["status"] == "out_of_memory" and row["held_to_gib"] == 17.76 and row["case"] == held.name
    assert row["reason"].startswith("CUDA out of memory") and "max_reserved_gib" in row and "alloc_retries" in row
    twin = next(c for c in suite.CASES if held.name == f"{c.name}_held_to_fit_margin")
    with pytest.raises(torch.OutOfMemoryError):
        suite.measure(suite.mtune_api(), twin, device="cpu", dry_run=True, workdir=tmp_path, args=None)


def test_a_traced_row_sets_the_model_on_the_allocators_history_beside_it(monkeypatch, tmp_path):
    # the CUDA calls stood in for: a history in which the allocator returned a freed 30 MiB segment for a 32 MiB
    # request under its 60 MiB limit (as torch.cuda.memory._snapshot() gives it), on a card of 600 MiB
    import torch
    from types import SimpleNamespace

    mib = 2**20
    entry = lambda action, addr, size: {"action": action, "addr": addr, "size": size, "stream": 0, "frames": []}
    trace = [entry("segment_alloc", 1, 30 * mib), entry("alloc", 1, 30 * mib), entry("segment_alloc", 2, 24 * mib),
             entry("alloc", 2, 24 * mib), entry("free_requested", 1, 30 * mib), entry("free_completed", 1, 30 * mib),
             entry("segment_free", 1, 30 * mib), entry("segment_alloc", 3, 32 * mib), entry("alloc", 3, 32 * mib)]
    recording = []
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [trace]})
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: recording.append(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=600 * mib))
    requests = tmp_path / "case.run.requests.json.gz"
    figures = suite.traced_allocator(SimpleNamespace(GIB=mib), 0.1, requests)  # 60 MiB of 600
    assert recording == [{"enabled": None}]  # recording stopped
    # the history's requests kept for allocator_margin.py --compare: its allocs and completed frees, in order
    assert margin_script.load_requests(requests) == [("alloc", 0, 30 * mib, 0), ("alloc", 1, 24 * mib, 0),
                                                     ("free", 0, 0, 0), ("alloc", 2, 32 * mib, 0)]
    assert figures == {"trace_entries": 9, "trace_requests": 3, "trace_max_reserved_gib": 56,
                       "trace_segment_frees": 1, "trace_out_of_memory": False, "model_max_reserved_gib": 56,
                       "model_max_allocated_gib": 56, "model_retries": 1, "model_refused_request": None}
