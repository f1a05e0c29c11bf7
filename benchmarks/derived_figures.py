"""Ratios and products that the docs quote between committed results files, computed from those files.

Each figure here is arithmetic on numbers other benchmarks wrote (no new measurement): writing it to a results
file lets ``scripts/check_figures.py`` check the quoted ratio against the files it came from instead of taking
the doc's word for it. Reads only ``benchmarks/results/``; writes three files, one per doc, so that a
paragraph cites only the ratios of its own topic: ``benchmarks/results/derived_head_to_head.json`` (the first two
lists), ``benchmarks/results/derived_memory_techniques.json`` (the next two) and
``benchmarks/results/derived_plan.json`` (the next) and ``benchmarks/results/derived_gpu_suite.json`` (the last):

- ``eager_to_compiled``: per head-to-head case and dtype, mtune's compiled tokens/s (``h2h_compile``) over its eager
  tokens/s of the fifth run (``h2h_fused_loss``); plus the bf16 full + checkpointing re-run
  (``h2h_full_ac_bf16_compile``), compiled over eager within that run.
- ``segments_over_dense_mask``: per case and dtype of ``h2h_packed_segments``, mtune's tokens/s with per-document
  attention over the same run's ``mtune:dense_mask`` tokens/s.
- ``optimizer_state_vs_adamw``: per row of ``memory_techniques.json``, its optimizer-state bytes over the fp32
  AdamW baseline's;
- ``offloading_totals``: per row of ``memory_techniques_offloading.json``, its device total over the fp32 AdamW
  baseline's and over the LoRA r8 fp32 row's;
- ``derived_plan.json``: the host AdamW step of Llama 3.1 8B (``host_adamw.json``'s bf16 seconds per parameter x
  the parameters ``plan_configs.json`` counts) and the low-memory full fine-tune's planned allocator peak against
  torchtune's published 18.9 GiB (cited in the script).
- ``derived_gpu_suite.json``: tokens/s quotients of GPU-suite case pairs (compiled over eager, QLoRA over LoRA) and
  each case's allocator margin (reserved - allocated) and memory beyond the allocator, the CUDA context, and the
  paged optimizer states measured against their plan, and part 16's held runs beside the allocator model's
  predictions (``gpu_suite_figures``, ``held_runs``), each row's MFU by its documents (``mfu_by_documents``); and
  from ``nf4_matmul.json`` each
  NF4 kernel's time for one 8B block's seven frozen matmuls, over the bf16 matmul's (``nf4_block_figures``).

    python benchmarks/derived_figures.py     # about a second
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
H2H = "torchtune_head_to_head.json"


def _summary(run: str) -> list[dict]:
    return json.loads((RESULTS / run / H2H).read_text())["summary"]


def _by_case(rows: list[dict], compiled: bool) -> dict[tuple[str, str], dict]:
    return {(r["case"], r["dtype"]): r for r in rows if bool(r["compile"]) == compiled}


def eager_to_compiled() -> list[dict]:
    """mtune's compiled over eager tokens/s, one record per case and dtype (ratio; tokens/s as the files give)."""
    eager = _by_case(_summary("h2h_fused_loss"), compiled=False)
    compiled = _by_case(_summary("h2h_compile"), compiled=True)
    missing = sorted(set(compiled) - set(eager))
    if missing:
        raise SystemExit(f"h2h_fused_loss has no eager run for {missing} of h2h_compile")
    # "compile": "on" as the compiled run's table row has it (the ratio belongs to that row)
    out = [{"runs": "h2h_fused_loss -> h2h_compile", "case": case, "dtype": dtype, "compile": "on",
            "eager_tokens_per_second": eager[case, dtype]["mtune"]["tokens_per_second"],
            "compiled_tokens_per_second": row["mtune"]["tokens_per_second"],
            "speedup": row["mtune"]["tokens_per_second"] / eager[case, dtype]["mtune"]["tokens_per_second"]}
           for (case, dtype), row in compiled.items()]
    rerun = _summary("h2h_full_ac_bf16_compile")
    (key,) = _by_case(rerun, compiled=True)  # the re-run holds one case, eager and compiled
    on, off = _by_case(rerun, True)[key], _by_case(rerun, False)[key]
    out.append({"runs": "h2h_full_ac_bf16_compile", "case": key[0], "dtype": key[1], "compile": "on",
                "eager_tokens_per_second": off["mtune"]["tokens_per_second"],
                "compiled_tokens_per_second": on["mtune"]["tokens_per_second"],
                "speedup": on["mtune"]["tokens_per_second"] / off["mtune"]["tokens_per_second"]})
    return out


def segments_over_dense_mask() -> list[dict]:
    """Per-document attention's tokens/s over the dense mask's, one record per case and dtype of one run."""
    out = []
    for row in _summary("h2h_packed_segments"):
        segments, dense = row["mtune"]["tokens_per_second"], row["mtune:dense_mask"]["tokens_per_second"]
        out.append({"runs": "h2h_packed_segments", "case": row["case"], "dtype": row["dtype"],
                    "speedup": segments / dense})
    return out


def optimizer_state_vs_adamw() -> list[dict]:
    """Each memory-technique row's optimizer-state bytes over the fp32 AdamW baseline's (ratio)."""
    rows = json.loads((RESULTS / "memory_techniques.json").read_text())["rows"]
    base = next(r for r in rows if r["name"] == "full fp32, AdamW (baseline)")["optimizer_state"]
    return [{"name": r["name"], "optimizer_state_ratio": r["optimizer_state"] / base} for r in rows]


def offloading_totals() -> list[dict]:
    """Each row of ``memory_techniques_offloading.json`` (run on its own): its device total over the full fp32 AdamW
    baseline's and over the plain LoRA r8 fp32 row's of ``memory_techniques.json`` (ratios), and the device bytes
    a GPU would move to the host in the bf16 + AC + offloading row (``offloadable_activations``) beside its
    activations."""
    rows = {r["name"]: r for r in json.loads((RESULTS / "memory_techniques.json").read_text())["rows"]}
    base, lora = rows["full fp32, AdamW (baseline)"]["total"], rows["LoRA r8 (q,k,v,o)"]["total"]
    offloading = json.loads((RESULTS / "memory_techniques_offloading.json").read_text())["rows"]
    return [{"name": r["name"], "total_ratio_to_baseline": r["total"] / base,
             "total_ratio_to_lora_r8_fp32": r["total"] / lora} for r in offloading]


# torchtune 0.6.1's published peak for Llama 3.1 8B full fine-tune, low memory (PagedAdamW8bit, optimizer in
# backward, checkpointing, batch 2 x 2048 packed, RTX 4090), as issue 22 quotes it: a cited figure, not a measurement
TORCHTUNE_LOW_MEMORY_PEAK_GIB = 18.9


def _plan(config: str) -> dict:
    (record,) = [r for r in json.loads((RESULTS / "plan_configs.json").read_text())["results"]
                 if r["config"] == config]
    return record


def planner_figures() -> dict:
    """docs/plan.md's arithmetic on committed files: the host AdamW step of Llama 3.1 8B's parameters at the measured
    bf16 seconds per parameter (``host_adamw.json`` x ``plan_configs.json``'s parameter count), and the low-memory
    full fine-tune's planned allocator peak against torchtune's published figure (a fraction: planned / published
    - 1)."""
    rows = json.loads((RESULTS / "host_adamw.json").read_text())["rows"]
    (bf16,) = [r for r in rows if r["dtype"] == "bfloat16"]
    full = _plan("llama3_1/8B_full_single_device")
    low = _plan("llama3_1/8B_full_single_device_low_memory")
    peak_gib = low["device_peak_bytes"] / 2**30
    return {"host_adamw_8b_step": {"name": "host AdamW step, Llama 3.1 8B, bf16",
                                   "parameters": full["parameters"]["total"],
                                   "step_seconds": bf16["seconds_per_param"] * full["parameters"]["total"]},
            "low_memory_vs_torchtune": {"name": low["config"], "planned_allocator_peak_gib": peak_gib,
                                        "torchtune_published_gib": TORCHTUNE_LOW_MEMORY_PEAK_GIB,
                                        "difference_fraction": peak_gib / TORCHTUNE_LOW_MEMORY_PEAK_GIB - 1}}


GPU_PAIRS = {
    # (numerator case, denominator case): what the quotient of their tokens/s says
    ("llama3_1_8B_lora_compiled_packed4096", "llama3_1_8B_lora_eager_packed4096"): "compiled over eager",
    ("llama3_2_1B_lora_compiled", "llama3_2_1B_lora_eager"): "compiled over eager",
    ("llama3_1_8B_qlora_compiled_packed4096", "llama3_1_8B_qlora_eager_packed4096"): "compiled over eager",
    ("llama3_1_8B_qlora_compiled_packed4096", "llama3_1_8B_lora_compiled_packed4096"): "QLoRA over LoRA",
    ("llama3_1_8B_qlora_eager_packed4096", "llama3_1_8B_lora_eager_packed4096"): "QLoRA over LoRA",
    ("llama3_1_8B_lora_activation_offloading", "llama3_1_8B_lora_eager_packed4096"): "technique over plain",
    ("llama3_1_8B_lora_weight_offloading_block", "llama3_1_8B_lora_eager_packed4096"): "technique over plain",
    ("llama3_1_8B_lora_weight_offloading_leaf", "llama3_1_8B_lora_eager_packed4096"): "technique over plain",
    ("llama3_1_8B_lora_fp8_storage", "llama3_1_8B_lora_eager_packed4096"): "technique over plain",
    ("llama3_1_8B_lora_compiled_packed4096", "llama3_1_8B_lora_compiled_dense_mask"): "varlen over dense mask",
    ("llama3_1_8B_qlora_compiled_packed4096", "llama3_1_8B_qlora_compiled_dense_mask"): "varlen over dense mask",
    ("llama3_1_8B_qlora_eager_packed4096", "llama3_1_8B_qlora_eager_torchao_dequantize_packed4096"):
        "NF4 kernel over torchao's dequantize",
    ("qwen3_moe_30B_A3B_qlora_packed4096", "qwen3_moe_30B_A3B_qlora_torchao_dequantize_packed4096"):
        "NF4 kernel over torchao's dequantize",
    ("qwen3_moe_30B_A3B_qlora_compiled_packed4096", "qwen3_moe_30B_A3B_qlora_packed4096"): "compiled over eager",
    ("qwen3_5_9B_lora_compiled_packed4096", "qwen3_5_9B_lora_packed4096"): "compiled over eager",
    ("qwen3_5_9B_lora_fla_packed4096", "qwen3_5_9B_lora_packed4096"):
        "flash-linear-attention's kernels over the PyTorch form",
    ("llama3_2_3B_lora_compiled_short_documents", "llama3_2_3B_lora_compiled_short_documents_row_bound"):
        "varlen bounded by the longest document over bounded by the row",
    ("qwen3_moe_30B_A3B_qlora_packed4096", "qwen3_moe_30B_A3B_qlora_experts_by_parts_packed4096"):
        "NF4 expert stacks dequantized whole over by eighths",
}

NF4_KERNEL_COMPILES_FROM = "2026-11-26T19:30:55+00:00"
"""When mtune's NF4 kernel began to compile in eager training steps (commit 42629d6): before, the first steps ran
under plan_check's byte tracker, where dynamo declined it for good, so its ops ran uncompiled. The NF4 pairs of
leases before this compare that uncompiled path with torchao's, and say so (``caveat``)."""

LEASE_MINUTES = 30
"""The longest a session holds a GPU machine: rows whose calls began within this many minutes of a lease's first
call are one lease (one machine, one set of versions), and a pair's quotient is taken within a lease."""


PAGED_CASES = ("llama3_1_8B_full_low_memory", "llama3_1_8B_full_paged_adamw8bit")
"""GPU-suite cases whose optimizer states are paged (bitsandbytes' managed memory): their plan's host figure is the
paged states, which live on the card beside the allocator."""


def _before(date: str, moment: str) -> bool:
    return datetime.datetime.fromisoformat(date) < datetime.datetime.fromisoformat(moment)


def _leases(rows: list[dict]) -> dict[str, str]:
    """Each of ``rows``' call dates -> the first call's date of its lease (:data:`LEASE_MINUTES`)."""
    leases: dict[str, str] = {}
    start = None
    for date in sorted({r["date"] for r in rows}, key=datetime.datetime.fromisoformat):
        moment = datetime.datetime.fromisoformat(date)
        if start is None or moment - start > datetime.timedelta(minutes=LEASE_MINUTES):
            start = moment
        leases[date] = start.isoformat()
    return leases


def _excess_s(row: dict) -> float:
    """Seconds a row's measured steps took beyond as many steps at its median timed step (``step_s``): its warm-up
    (compilation, first-use allocations, the tracked steps), the timed steps' scatter about their median aside."""
    return sum(row["step_times_s"]) - len(row["step_times_s"]) * row["step_s"]


def _compile_payback(compiled: dict, eager: dict) -> dict:
    """After how many steps a compiled run has caught up with its eager twin: the extra warm-up compilation costs
    over the eager run's own, divided by what each compiled step saves."""
    extra = _excess_s(compiled) - _excess_s(eager)
    saving = eager["step_s"] - compiled["step_s"]
    return {"compile_extra_warmup_s": extra, "step_saving_s": saving,
            "pays_back_after_steps": extra / saving if saving > 0 else None}


def mfu_by_documents(rows: list[dict]) -> list[dict]:
    """Each measured suite row's MFU by the count mtune's runs make of its batch (``StepFlops``: each packed
    document's attention against itself under the segment kernels, the whole row under the dense mask). Rows that
    say their ``attention_len`` were counted so; the earlier ones counted attention over the whole row, on batches of
    two documents of half a row each, so their count falls by half the row's attention FLOPs per token (FLOPs are
    affine in the attention length, ``mtune/training/observe/flops.py``), but for the dense mask's rows."""
    out = []
    for r in rows:
        if r["status"] != "ok" or not r.get("gpu_name") or r.get("mfu") is None \
                or "attention_flops_per_token" not in r:  # the head-to-head's MFU is its harness's own count
            continue
        recorded = "attention_len" in r
        share = 1.0 if recorded or "attention_kernel=dense_mask" in r["what"] else 0.5
        model = r["model_flops_per_token"] - r["attention_flops_per_token"] * (1 - share)
        out.append({"case": r["case"], "date": r["date"], "gpu_name": r["gpu_name"],
                    "attention_len": r["attention_len"] if recorded else r["seq_len"] * share,
                    "mfu_recorded": r["mfu"], "mfu": r["mfu"] * model / r["model_flops_per_token"]})
    return out


def gpu_suite_figures() -> dict:
    """docs/benchmarks.md's arithmetic on ``gpu_suite.json`` (the latest ``ok`` row of each case on each GPU):
    tokens/s quotients of case pairs (:data:`GPU_PAIRS`: both rows from each lease that ran both, and each case's
    latest row where no lease did or either was measured again after the last that did), and per case the
    allocator's margin (max reserved - max allocated, GiB) and what the card held beyond the allocator
    (``device_used_gib`` - max reserved: the CUDA context, and managed memory such as paged optimizer states)."""
    rows = json.loads((RESULTS / "gpu_suite.json").read_text())["rows"]
    ok = [r for r in rows if r["status"] == "ok" and r.get("gpu_name")]
    latest = {(r["gpu_name"], r["case"]): r for r in ok}
    lease_of = _leases(ok)
    in_lease = {(r["gpu_name"], lease_of[r["date"]], r["case"]): r for r in ok}  # the lease's last row of a case
    pairs = []
    for (top, bottom), what in GPU_PAIRS.items():
        for gpu in sorted({g for g, _ in latest}):
            both = sorted(lease for g, lease, case in in_lease if g == gpu and case == top
                          and (gpu, lease, bottom) in in_lease)
            # each lease that measured both (speeds compared on one machine), oldest first; then each case's latest
            # row, with the two leases named, where no lease ran both or a case was measured again since the last that
            # did (the code may have changed in between)
            chosen = [(in_lease[gpu, lease, top], in_lease[gpu, lease, bottom], "one lease") for lease in both]
            newest = (latest.get((gpu, top)), latest.get((gpu, bottom)), "each case's latest row")
            if all(newest[:2]) and (not chosen or newest[:2] != chosen[-1][:2]):
                chosen.append(newest)
            for over, under, basis in chosen:
                pair = {"name": f"{top} / {bottom}", "gpu_name": gpu, "what": what, "basis": basis,
                        "leases": sorted({lease_of[over["date"]], lease_of[under["date"]]}),
                        "ratio": over["tokens_per_s"] / under["tokens_per_s"]}
                if what.startswith("NF4 kernel") and _before(over["date"], NF4_KERNEL_COMPILES_FROM):
                    pair["caveat"] = "the kernel's ops ran uncompiled in these steps (NF4_KERNEL_COMPILES_FROM)"
                if what == "compiled over eager":
                    pair.update(_compile_payback(over, under))
                pairs.append(pair)
    margins = [{"name": case, "gpu_name": gpu,
                "reserved_minus_allocated_gib": r["max_reserved_gib"] - r["max_allocated_gib"],
                **({"device_used_minus_reserved_gib": r["device_used_gib"] - r["max_reserved_gib"]}
                   if r.get("device_used_gib") is not None else {})}
               for (gpu, case), r in latest.items()
               if r.get("kind", "run") == "run" and r.get("max_reserved_gib") is not None]
    # head-to-head rows are left out: their allocated peak was read at the end of the run, after mtune's last reset
    # the CUDA context: what the card holds beyond the allocator on rows that plan nothing off the allocator
    plain = [r["device_used_gib"] - r["max_reserved_gib"] for r in latest.values()
             if r.get("kind", "run") == "run" and r.get("device_used_gib") is not None and not r.get("planned_host_gib")]
    context = statistics.median(plain) if plain else None
    managed = [{"name": case, "gpu_name": gpu, "context_gib": context,
                "measured_managed_gib": r["device_used_gib"] - r["max_reserved_gib"] - context,
                "planned_managed_gib": r["planned_host_gib"],
                "plan_error": r["planned_host_gib"] / (r["device_used_gib"] - r["max_reserved_gib"] - context) - 1}
               for (gpu, case), r in latest.items() if case in PAGED_CASES and context is not None]
    predictions = json.loads((RESULTS / "allocator_margin.json").read_text())["rows"]
    return {"tokens_per_s_pairs": pairs, "allocator_margins": margins, "cuda_context_gib": context,
            "paged_states": managed, "held_runs": held_runs(rows, predictions),
            "mfu_by_documents": mfu_by_documents(rows)}


HELD_SUFFIX = "_held_to_fit_margin"
"""The GPU suite's part 16 rows: each case's twin held to the allocator limit --fit's tightest budget leaves it."""


def held_runs(rows: list[dict], predictions: list[dict]) -> list[dict]:
    """Each part 16 row (the latest of each case on each GPU, served or refused) beside what
    ``allocator_margin.json`` predicted for its unheld twin's plan (``fit_spare_after_run_gib``: --fit's margin
    less the held model's need and the twin's run beyond its plan; negative: refused) and beside the model on the
    row's own allocator history (whether the model, held alike, reserved what the allocator did and refused what it
    refused)."""
    latest = {(r["gpu_name"], r["case"]): r for r in rows
              if r["case"].endswith(HELD_SUFFIX) and r.get("gpu_name") and r["status"] in ("ok", "out_of_memory")}
    spare = {p["case"]: p.get("fit_spare_after_run_gib") for p in predictions}
    out = []
    for (gpu, case), r in latest.items():
        served = r["status"] == "ok"
        twin = case[: -len(HELD_SUFFIX)]
        record = {"name": case, "gpu_name": gpu, "served": served, "held_to_gib": r.get("held_to_gib"),
                  "max_allocated_gib": r.get("max_allocated_gib"), "max_reserved_gib": r.get("max_reserved_gib"),
                  "alloc_retries": r.get("alloc_retries"), "syncs_all_streams": r.get("syncs_all_streams"),
                  # what the allocator did where the row says (segments_expandable), else what its process asked
                  "expandable_segments": r["segments_expandable"] if r.get("segments_expandable") is not None
                  else r.get("expandable_segments"), "predicted_spare_gib": spare.get(twin)}
        record["prediction_held"] = None if spare.get(twin) is None else (spare[twin] >= 0) == served
        if r.get("trace_max_reserved_gib") is not None:
            refused = r["model_refused_request"] is not None
            record.update(trace_max_reserved_gib=r["trace_max_reserved_gib"],
                          model_max_reserved_gib=r["model_max_reserved_gib"], model_on_trace_refused=refused,
                          model_on_trace_agrees=refused == r["trace_out_of_memory"]
                          and (not served or r["model_max_reserved_gib"] == r["trace_max_reserved_gib"]))
        out.append(record)
    return out


NF4_BLOCK_LINEARS = {"q_proj/o_proj": 2, "k_proj/v_proj": 2, "gate_proj/up_proj": 2, "down_proj": 1}
"""How many of each ``nf4_matmul.json`` shape one Llama 3.1 8B block holds."""


def nf4_block_figures() -> list[dict]:
    """Per variant of ``nf4_matmul.json``: the seconds of one 8B block's seven frozen matmuls (forward and the
    input's gradient, the sum of their medians) and that over the bf16 matmul of the dequantized weights."""
    path = RESULTS / "nf4_matmul.json"
    if not path.exists():
        return []
    rows = json.loads(path.read_text())["rows"]
    sums: dict[str, float] = {}
    for row in rows:
        sums[row["variant"]] = sums.get(row["variant"], 0.0) + NF4_BLOCK_LINEARS[row["shape"]] * row["seconds"]
    baseline = sums["bf16 (dequantized once)"]
    return [{"name": variant, "block_seconds": seconds, "over_bf16": seconds / baseline}
            for variant, seconds in sums.items()]


def main(out_dir: Path = RESULTS) -> None:
    """Writes the files into ``out_dir`` (default ``benchmarks/results/``; a test writes them to a tmp dir)."""
    note = "ratios of committed results files, computed by benchmarks/derived_figures.py"
    outputs = {"derived_head_to_head.json": {"note": note, "eager_to_compiled": eager_to_compiled(),
                                             "segments_over_dense_mask": segments_over_dense_mask()},
               "derived_memory_techniques.json": {"note": note,
                                                  "optimizer_state_vs_adamw": optimizer_state_vs_adamw(),
                                                  "offloading_totals": offloading_totals()},
               "derived_plan.json": {"note": note, **planner_figures()},
               "derived_gpu_suite.json": {"note": note, **gpu_suite_figures(),
                                          "nf4_matmul_per_block": nf4_block_figures()}}
    for name, figures in outputs.items():
        path = out_dir / name
        path.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
