"""How far a QLoRA run's merged export is from the NF4 model it trained, on the tiny random test model
(``tests/mtune/training/checkpointing/test_peft.py``'s case: hidden 256, 2 layers, vocabulary 512, fp32, q/v/o
adapted with trained-looking adapters, 2 x 32 tokens): the logits of the merged original-precision checkpoint
against the NF4 model's, for LoRA and DoRA. Writes ``benchmarks/results/qlora_merge_distance.json``.

    python benchmarks/qlora_merge_distance.py
"""

import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402

from mtune.training.checkpointing.merge import save_merged_model  # noqa: E402
from tests._helpers.lora import trained_lora_model  # noqa: E402
from tests._helpers.models import write_tiny_hf_model  # noqa: E402
from tests.mtune.training.checkpointing.test_peft import TOKENS, logits  # noqa: E402


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = write_tiny_hf_model(Path(tmp) / "base", "llama3_1")
        for use_dora in (False, True):
            qlora = trained_lora_model(base_dir, use_dora=use_dora, quantize_base=True,
                                       modules=["q_proj", "v_proj", "o_proj"])
            trained = logits(qlora)
            out = Path(tmp) / f"merged_{use_dora}"
            save_merged_model(base_dir, qlora, out)
            merged = logits(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())
            diff = (merged - trained).abs()
            rows.append({"adapter": "DoRA" if use_dora else "LoRA", "max_abs_logit_diff": diff.max().item(),
                         "mean_abs_logit_diff": diff.mean().item(),
                         "same_argmax_fraction": (merged.argmax(-1) == trained.argmax(-1)).float().mean().item(),
                         "positions": int(trained.shape[0] * trained.shape[1]),
                         "trained_logits_std": trained.std().item()})
            print(rows[-1])
    out = REPO / "benchmarks" / "results" / "qlora_merge_distance.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/qlora_merge_distance.py", "tokens": list(TOKENS.shape),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "rows": rows}, indent=1) + "\n")
    print(f"json: {out}")


if __name__ == "__main__":
    main()
