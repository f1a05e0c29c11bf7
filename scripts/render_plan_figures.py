"""Write `mtune plan`'s figures (benchmarks/results/plan_configs.json, from benchmarks/plan_configs.py) into the
shipped configs' header memory block and docs/configs.md's memory table, so no memory figure there is hand-made.

    python benchmarks/plan_configs.py $(python scripts/render_plan_figures.py --list)   # plan them (slow)
    python scripts/render_plan_figures.py                                                # write the figures
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "plan_configs.json"
CONFIGS = REPO / "recipes" / "configs"
GIB = 1024**3
NAMES = {"parameters": "weights", "gradients": "gradients", "optimizer_state": "optimizer state",
         "activations": "activations", "temporaries": "temporaries", "buffers": "buffers"}


def single_device_configs() -> list[str]:
    return sorted(str(p.relative_to(CONFIGS))[:-5] for p in CONFIGS.glob("*/*_single_device*.yaml")
                  if not p.parent.name == "tiny")


def header_block(result: dict) -> list[str]:
    batch = result["batch"]
    at_peak = {k: v for k, v in result["at_peak"]["device"].items() if v >= 0.05 * GIB}
    parts = ", ".join(f"{NAMES[k]} {v / GIB:.1f}" for k, v in at_peak.items())
    lines = [f"# Memory planned by `mtune plan` (device=cuda; every sample at max_seq_len={batch['seq_len']}, "
             f"batch_size={batch['batch_size']}):",
             f"#   GPU {result['device_peak_bytes'] / GIB:.1f} GiB allocated at the peak ({parts})",
             f"#   + 0.5 GiB CUDA context = {result['device_total_bytes'] / GIB:.1f} GiB"
             + (f"; host {result['host_peak_bytes'] / GIB:.1f} GiB" if result["host_peak_bytes"] else "") + ".",
             "#   Alpaca samples are mostly far shorter than max_seq_len (batches pad to their longest), so real "
             "peaks are lower."]
    return lines


def rewrite_header(config: str, result: dict) -> None:
    path = CONFIGS / f"{config}.yaml"
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Memory"))
    end = next(i for i, line in enumerate(lines) if line.startswith("recipe:"))
    if any(line.startswith("#   Sharded") or "paged" in line for line in lines[start:end]):
        pass  # the paging caveat is replaced by the planned figure too
    path.write_text("\n".join(lines[:start] + header_block(result) + lines[end:]) + "\n")


def rewrite_table(results: dict[str, dict]) -> None:
    path = REPO / "docs" / "configs.md"
    text = path.read_text()
    out = []
    for line in text.splitlines():
        match = re.match(r"\| `([^`]+)` \| `([^`]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", line)
        if line.startswith("| config | recipe | batch × accumulation |"):
            line = "| config | recipe | batch × accumulation | planned GPU (GiB) | host (GiB) | source |"
        elif line.startswith("|---|---|---|---|---|"):
            line = "|---|---|---|---:|---:|---|"
        elif match and match.group(1) in results:
            r = results[match.group(1)]
            line = (f"| `{match.group(1)}` | `{match.group(2)}` | {match.group(3).strip()} | "
                    f"{r['device_total_bytes'] / GIB:.1f} | {r['host_peak_bytes'] / GIB:.1f} | `mtune plan` |")
        elif match:
            line = (f"| `{match.group(1)}` | `{match.group(2)}` | {match.group(3).strip()} | "
                    f"{match.group(4).strip()} | - | arithmetic (not planned: distributed) |")
        out.append(line)
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    if "--list" in sys.argv:
        print(" ".join(single_device_configs()))
        return
    results = {r["config"]: r for r in json.loads(RESULTS.read_text())["results"]}
    for config, result in results.items():
        if (CONFIGS / f"{config}.yaml").exists():
            rewrite_header(config, result)
    rewrite_table(results)
    print(f"wrote {len(results)} configs' figures")


if __name__ == "__main__":
    main()
