"""Anonymous memory while loading a sharded ~1 GB Hugging Face checkpoint into a model built on meta.

Writes the checkpoint with mtune (``save_hf_checkpoint`` of a randomly initialised model), then loads it in fresh
processes: mtune's streamed loader (model on meta, one tensor at a time), and for contrast a naive load (a
materialised model, every shard read with ``safetensors.torch.load_file`` into one state dict, then
``load_state_dict``). RssAnon is sampled from /proc/self/status every millisecond during the load.

    python benchmarks/checkpoint_load_memory.py [--out benchmarks/results/checkpoint_load_memory.json] [--keep DIR]
"""

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ~266M parameters, fp32: 1.06 GB in shards of at most 200 MB (the embedding alone is 262 MB, so it gets its own).
SHAPE = dict(vocab_size=32000, dim=2048, intermediate_dim=5632, n_layers=3, n_heads=32, n_kv_heads=8, head_dim=64)
MiB = 2**20


def rss(field: str = "RssAnon") -> int:
    """Bytes of ``field`` (RssAnon: heap and anonymous maps; RssFile: mapped files) from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def write_checkpoint(root: str) -> None:
    import torch

    from mtune.models import build_model
    from mtune.training.checkpointing.hf import save_hf_checkpoint

    torch.manual_seed(0)
    save_hf_checkpoint(build_model("llama2", "tiny", device="cpu", **SHAPE), Path(root) / "llama2",
                       max_shard_size="200MB")


def measure(method: str, ckpt: str, queue) -> None:
    import torch

    from mtune.training.checkpointing.hf import load_hf_config, load_model_from_hf, weight_files
    from mtune.models import build_model_from_args

    peak, peak_file, stop = [0], [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            peak_file[0] = max(peak_file[0], rss("RssFile"))
            time.sleep(0.001)

    base, base_file = rss(), rss("RssFile")
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    if method == "mtune streamed":
        model = load_model_from_hf(ckpt)
    else:
        from safetensors.torch import load_file

        model = build_model_from_args(load_hf_config(ckpt)[1], device="cpu")
        state = {}
        for path in weight_files(ckpt):
            state.update((k.removeprefix("model."), v) for k, v in load_file(path).items())
        model.load_state_dict(state)
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    after = rss()
    peak[0] = max(peak[0], after)
    peak_file[0] = max(peak_file[0], rss("RssFile"))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    queue.put(dict(method=method, model_bytes=model_bytes, baseline=base, peak=peak[0], after=after, seconds=seconds,
                   peak_file_extra=peak_file[0] - base_file))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/checkpoint_load_memory.json")
    parser.add_argument("--keep", help="write the checkpoint here instead of a temporary directory")
    opts = parser.parse_args()
    ctx = mp.get_context("spawn")  # each load in a fresh interpreter, so earlier allocations do not blur RssAnon
    with tempfile.TemporaryDirectory() as tmp:
        root = opts.keep or tmp
        proc = ctx.Process(target=write_checkpoint, args=(root,))
        proc.start()
        proc.join()
        ckpt = Path(root) / "llama2"
        shards = sorted(ckpt.glob("*.safetensors"))
        largest = max(p.stat().st_size for p in shards)
        total = sum(p.stat().st_size for p in shards)
        rows = []
        for method in ("mtune streamed", "naive load_file"):
            queue = ctx.Queue()
            proc = ctx.Process(target=measure, args=(method, str(ckpt), queue))
            proc.start()
            rows.append(queue.get())
            proc.join()
    print(f"checkpoint: {len(shards)} shards, {total / MiB:.0f} MiB, "
          f"largest shard {largest / MiB:.0f} MiB")
    print(f"{'method':<24}{'model MiB':>10}{'peak extra anon MiB':>21}{'extra/largest shard':>21}"
          f"{'peak mapped-file MiB':>22}{'seconds':>9}")
    for row in rows:
        row["peak_extra"] = row["peak"] - row["baseline"] - row["model_bytes"]
        row["extra_over_largest_shard"] = row["peak_extra"] / largest
        print(f"{row['method']:<24}{row['model_bytes'] / MiB:>10.0f}{row['peak_extra'] / MiB:>21.0f}"
              f"{row['extra_over_largest_shard']:>21.2f}{row['peak_file_extra'] / MiB:>22.0f}{row['seconds']:>9.2f}")
    machine = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "load_average": os.getloadavg()}
    result = dict(machine=machine, n_shards=len(shards), checkpoint_bytes=total, largest_shard_bytes=largest,
                  rows=rows)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
