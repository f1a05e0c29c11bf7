#!/usr/bin/env bash
# One call of a GPU lease, on the lent machine (device tool), from the repository root: item N of docs/benchmarks.md
# "What is left for a GPU". Writes gpu_suite.json, suite.log and logs.tgz under $OUT; merge them here afterwards
# (gpu_suite.write_results, then benchmarks/derived_figures.py). What each item must carry (run(carry=...)):
#   1: .whl                                part 17's other three rows: part 16's held to --fit's margin with
#                                          expandable segments, mtune's allocator setting since the seventh lease;
#                                          and part 16's host optimizer row again, its history now with free_requested
#   2: .whl                                the leaf-level offloading row again, part 15 (the MoE QLoRA step compiled)
#   3: .whl                                part 7 and the compiled Qwen3.5 row (~8 min: a call of its own)
#   4: .whl_triton .whl/fla .whl/base     Qwen3.5 9B on fla's kernels beside its PyTorch-form twin in one call (on any
#                                          machine, fresh or warm: it installs what it needs; CASES=... SUITE_S=...
#                                          narrow it; a cold machine's first fla step compiles for minutes)
#   5: .whl                                part 18 (the varlen bound from the batch's longest document against the
#                                          row, twins on 96-token documents), part 19 (8B LoRA compiled as --fit
#                                          configures it for the card), then the head-to-head with torchtune 0.6.1
#                                          (parity over four steps, profiles) against the seventh lease's row
#   6: .whl                                the MoE QLoRA step and part 20's twin (its NF4 expert stacks
#                                          dequantized by eighths, as before 2026-11-27), in one call
# A machine stays warm (and keeps /tmp) only about 30 seconds after a call, so every item installs what it needs
# unless an earlier call of the same machine did (into /tmp/site): any item may come first on a fresh machine.
set -uo pipefail
item="${1:?usage: bash scripts/gpu_lease.sh ITEM (1-6)}"
OUT="${OUT:?OUT: the device tool sets it}"
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
versions() {  # what the machine runs, first in a lease's log
  PYTHONPATH=/tmp/site python3 -m pip list 2>/dev/null | grep -iE '^(torch|torchao|transformers|bitsandbytes|triton) '
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
}
install_site() {  # mtune's wheels into /tmp/site, unless an earlier call of this machine installed them
  [ -d /tmp/site/torchao ] || pip_target /tmp/site .whl/*.whl .whl/base/*.whl || exit
}
suite() {  # suite WORKDIR SECONDS ARGS...: the suite's cases under a timeout, its log and the cases' logs to $OUT
  local work="$1" seconds="$2"; shift 2
  PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout "$seconds" python3 benchmarks/gpu_suite.py --budget-s 9000 \
    --out "$OUT/gpu_suite.json" --work "$work" "$@" 2>&1 | tee "$OUT/suite.log"
  (cd "$work" && tar czf "$OUT/logs.tgz" --ignore-failed-read ./*.log ./*.requests.json.gz 2>/dev/null || true)
}
case "$item" in
  1)
    install_site
    versions
    suite /tmp/gs1 420 --cases llama3_1_8B_full_optimizer_offload_expandable_held_to_fit_margin \
      llama3_1_8B_lora_activation_offloading_expandable_held_to_fit_margin \
      llama3_1_8B_qlora_eager_torchao_dequantize_packed4096_expandable_held_to_fit_margin \
      llama3_1_8B_full_optimizer_offload_held_to_fit_margin ;;
  2)
    install_site
    versions
    suite /tmp/gs2 300 --cases llama3_1_8B_lora_weight_offloading_leaf qwen3_moe_30B_A3B_qlora_compiled_packed4096 ;;
  3)
    install_site
    versions
    suite /tmp/gs3 540 --cases llama3_1_8B_lora_packed4096_segments qwen3_5_9B_lora_compiled_packed4096 \
      llama3_1_8B_lora_longest_planned_context ;;
  4)
    pip_target /tmp/site .whl/base/*.whl || exit
    versions
    echo "$(cat .whl_triton/SHA256)  .whl_triton/triton.tar.xz" | sha256sum -c || exit
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
      .whl_triton/triton.tar.xz /tmp/site_triton || exit
    pip_target /tmp/site_fla .whl/fla/*.whl || exit
    TRITON_PRINT_AUTOTUNING=1 suite /tmp/gs4 "${SUITE_S:-540}" --fla-path /tmp/site_triton:/tmp/site_fla \
      --cases ${CASES:-qwen3_5_9B_lora_packed4096 qwen3_5_9B_lora_fla_packed4096} ;;
  5)
    install_site
    versions
    pip_target /tmp/site_tt .whl/torchtune/*.whl || exit
    suite /tmp/gs5 540 --torchtune-path /tmp/site_tt:/tmp/site --cases llama3_2_3B_lora_compiled_short_documents \
      llama3_2_3B_lora_compiled_short_documents_row_bound llama3_1_8B_lora_compiled_fit_78GiB \
      llama3_2_3B_lora_head_to_head ;;
  6)
    install_site
    versions
    suite /tmp/gs6 330 --cases qwen3_moe_30B_A3B_qlora_packed4096 \
      qwen3_moe_30B_A3B_qlora_experts_by_parts_packed4096 ;;
  *)
    echo "no item $item (1-6)" >&2; exit 2 ;;
esac
