"""Seconds per parameter of AdamW's step on this machine's CPU: what ``optimizer_offload: cpu`` costs each step
(`mtune.training.planning.cost.HOST_ADAMW_SECONDS_PER_PARAM` states the figure measured here).

Steps torch's fused CPU AdamW (what ``build_optimizer`` builds for the host) over bf16 parameters of a few large
tensors, as an offloaded full fine-tune holds them, and prints a table and writes
``benchmarks/results/host_adamw.json``. ``python benchmarks/host_adamw.py [MILLION_PARAMS ...]``."""

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch


def measure(million: int, dtype: torch.dtype, steps: int = 5) -> float:
    params = [torch.nn.Parameter(torch.randn(million, 1 << 20, dtype=dtype) * 0.01) for _ in range(1)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    optimizer.step()  # creates the states
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps / sum(p.numel() for p in params)


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [64, 256]
    rows = []
    for million in sizes:
        for dtype in (torch.bfloat16, torch.float32):
            rows.append({"params_m": million, "dtype": str(dtype).removeprefix("torch."),
                         "seconds_per_param": measure(million, dtype)})
    print(f"{'params (Mi)':>12} {'dtype':>9} {'s/param':>10} {'8B step (s)':>12}")
    for row in rows:
        print(f"{row['params_m']:>12} {row['dtype']:>9} {row['seconds_per_param']:>10.2e} "
              f"{row['seconds_per_param'] * 8.03e9:>12.1f}")
    out = Path(__file__).parent / "results" / "host_adamw.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
                               "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "load_average": os.getloadavg(), "rows": rows}, indent=1) + "\n")
    print(f"json: {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
