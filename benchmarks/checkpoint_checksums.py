#!/usr/bin/env python
"""Checkpoint checksums' cost: the save time of a whole checkpoint (a full fine-tune's HF model and recipe_state.pt
with AdamW states) with CRC-32 against the same save with the hashing turned off; interleaved, best of N. Also the
throughput of ``zlib.crc32`` and ``hashlib.sha256`` over 256 MiB on one core. Writes
``benchmarks/results/checkpoint_checksums.json`` (with the machine, date and load).

    python benchmarks/checkpoint_checksums.py FAMILY SIZE N      # e.g. tiny tiny 5
"""
import datetime, hashlib, json, os, platform, sys, time, tempfile, shutil, zlib
from pathlib import Path
import torch
import mtune.training.checkpointing.manifest as mf
from mtune.models import build_model_from_args, model_args
from mtune.training.checkpointing.checkpointer import Checkpointer

family, size, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with torch.device("cpu"):
    model = build_model_from_args(model_args(family, size), dtype=torch.float32)
model.to_empty(device="cpu"); model.init_weights()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sum(p.sum() for p in model.parameters()).backward(); opt.step()
root = Path(tempfile.mkdtemp())
ck = Checkpointer(output_dir=root, config={}, base_checkpoint_dir=None, keep_last_n_checkpoints=1)
real_crc = mf.zlib.crc32
class NoHash:  # the same code path, no CRC computed
    @staticmethod
    def crc32(data, value=0): return 0
times = {"with": [], "without": []}
for i in range(n):
    for label in ("without", "with"):
        mf.zlib = zlib if label == "with" else NoHash
        t = time.perf_counter(); ck.save(step=i * 2 + (label == "with"), epoch=0, model=model, optimizer=opt)
        times[label].append(time.perf_counter() - t)
mf.zlib = zlib
nbytes = sum(p.stat().st_size for p in (root / f"step_{2 * n - 1}").rglob("*") if p.is_file())
t0 = time.perf_counter(); assert not mf.verify_checkpoint(root / f"step_{2 * n - 1}"); tv = time.perf_counter() - t0
w, wo = min(times["with"]), min(times["without"])
print(f"{family} {size}: checkpoint {nbytes / 2**20:.1f} MiB; save {wo:.3f} s without CRC-32, {w:.3f} s with "
      f"({(w / wo - 1) * 100:+.1f}%); verify {tv:.3f} s")
shutil.rmtree(root)
block = os.urandom(1 << 20) * 256  # 256 MiB


def best_seconds(fn, reps=3):
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)


crc_gb_per_s = len(block) / best_seconds(lambda: zlib.crc32(block)) / 1e9
sha_gb_per_s = len(block) / best_seconds(lambda: hashlib.sha256(block).digest()) / 1e9
print(f"crc32 {crc_gb_per_s:.2f} GB/s, sha256 {sha_gb_per_s:.2f} GB/s (one core)")
out = Path(__file__).resolve().parent / "results" / "checkpoint_checksums.json"
out.write_text(json.dumps({
    "command": f"python benchmarks/checkpoint_checksums.py {family} {size} {n}",
    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "load_average": os.getloadavg()},
    "checkpoint_bytes": nbytes, "save_seconds_without_crc": wo, "save_seconds_with_crc": w,
    "save_seconds_all": times, "verify_seconds": tv,
    "crc32_gb_per_s": crc_gb_per_s, "sha256_gb_per_s": sha_gb_per_s}, indent=1) + "\n")
print(f"json: {out}")
