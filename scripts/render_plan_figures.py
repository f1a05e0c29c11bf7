"""Write `mtune plan`'s figures (benchmarks/results/plan_configs.json, from benchmarks/plan_configs.py) into the
shipped configs' header memory block, docs/configs.md's memory table and docs/plan.md's cost-of-planning tables (each
row the config's latest plan, with its date and load average), so no memory figure there is hand-made.

    python benchmarks/plan_configs.py $(python scripts/render_plan_figures.py --list)   # plan them (slow)
    python scripts/render_plan_figures.py                                                # write the figures
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: mtune from this checkout
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "plan_configs.json"
CONFIGS = REPO / "recipes" / "configs"
GIB = 1024**3
NAMES = {"parameters": "weights", "gradients": "gradients", "optimizer_state": "optimizer state",
         "activations": "activations", "temporaries": "temporaries", "buffers": "buffers"}


def shipped_training_configs() -> list[str]:
    """The shipped configs (not the tiny test ones): distributed first, then single-device, each sorted."""
    return [name for pattern in ("*/*_*_distributed.yaml", "*/*_single_device*.yaml")
            for name in sorted(str(p.relative_to(CONFIGS))[:-5] for p in CONFIGS.glob(pattern)
                               if p.parent.name != "tiny")]


GPU_SIZES_GB = (4, 6, 8, 12, 16, 24, 32, 40, 48, 80, 141)


def device_total(result: dict) -> int:
    """The whole-GPU figure of a plan_configs.json record: its allocator peak, as planned, plus the CUDA context as
    the planner states it now (``CUDA_CONTEXT_BYTES``, an input of the plan, not something it computes: a change to
    it re-renders the figures without planning again)."""
    return result["device_peak_bytes"] + CUDA_CONTEXT_BYTES


def gpu_size(total_bytes: int, ranks: int = 1) -> str:
    """The smallest common GPU (decimal GB, as sold) whose memory holds ``total_bytes``: "a 24 GB GPU", "an 80 GB
    GPU", "4 x 24 GB GPUs" for ``ranks`` of them."""
    size = next((gb for gb in GPU_SIZES_GB if gb * 10**9 >= total_bytes), None)
    if size is None:
        return "no common GPU size"
    if ranks > 1:
        return f"{ranks} x {size} GB GPUs"
    return f"{'an' if str(size).startswith('8') else 'a'} {size} GB GPU"


def _config_value(config: str, key: str) -> str | None:
    """A top-level scalar of a shipped config, read from its text (``reference: copy   # ...`` -> ``copy``)."""
    for line in (CONFIGS / f"{config}.yaml").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return line.split(":", 1)[1].split("#", 1)[0].strip()
    return None


def header_block(result: dict) -> list[str]:
    batch = result["batch"]
    at_peak = {k: v for k, v in result["at_peak"]["device"].items() if v >= 0.05 * GIB}
    parts = ", ".join(f"{NAMES[k]} {v / GIB:.1f}" for k, v in at_peak.items())
    ranks = result.get("world_size", 1)
    per_gpu = f" per GPU, {ranks} ranks" if ranks > 1 else ""
    pairs = "_dpo_" in result["recipe"]  # a preference recipe: a batch of pairs, chosen and rejected rows
    if pairs:
        n = batch["batch_size"]
        what = (f"reference={_config_value(result['config'], 'reference')}; every pair at "
                f"max_seq_len={batch['seq_len']}, batch_size={n} pair{'s' if n > 1 else ''} = {2 * n} rows")
        data = ("#   UltraFeedback responses are mostly shorter than max_seq_len (batches pad to their longest), so "
                "real peaks are", "#   lower. The other reference choices, planned: docs/memory.md.")
    else:
        what = f"every sample at max_seq_len={batch['seq_len']}, batch_size={batch['batch_size']}"
        data = ("#   Alpaca samples are mostly far shorter than max_seq_len (batches pad to their longest), so real "
                "peaks are lower.",)
    first = f"# Memory planned by `mtune plan` (device=cuda{per_gpu}; {what}):"
    cut = first.rfind("; ", 0, 118) if len(first) > 118 else -1  # a header line stays within 118 characters
    lines = [first] if cut < 0 else [first[:cut + 1], "#   " + first[cut + 2:]]
    lines += [f"#   GPU {result['device_peak_bytes'] / GIB:.1f} GiB allocated at the peak ({parts})",
              f"#   + {CUDA_CONTEXT_BYTES / GIB:.1f} GiB CUDA context = {device_total(result) / GIB:.1f} GiB"
              + (f"; host {result['host_peak_bytes'] / GIB:.1f} GiB" if result["host_peak_bytes"] else "")
              + f": fits {gpu_size(device_total(result), ranks)}.",
              *data]
    if ranks > 1:
        lines.insert(-len(data), "#   Sharded state scales with 1/ranks (mtune plan --nproc_per_node N plans another "
                                 "count).")
    return lines


def rendered_header(config: str, result: dict) -> str:
    """The config file's text with its header memory block rendered from ``result`` (its plan_configs.json record)."""
    path = CONFIGS / f"{config}.yaml"
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Memory"))
    end = next(i for i, line in enumerate(lines) if line.startswith("recipe:"))
    block = header_block(result)
    if any("_component_: bitsandbytes.optim.Paged" in line for line in lines):
        block[-1:-1] = ["#   The paged optimizer state lives in CUDA managed memory, outside the GPU's allocator: it is",
                        "#   counted on the host, and the driver pages it to the GPU as it is stepped (slower)."]
    return "\n".join(lines[:start] + block + lines[end:]) + "\n"


def rendered_table(results: dict[str, dict]) -> str:
    """docs/configs.md's text with its memory table's rows rendered from ``results`` (plan_configs.json's records by
    config)."""
    text = (REPO / "docs" / "configs.md").read_text()
    out = []
    for line in text.splitlines():
        # rows as first written (five cells) or as rendered before (a sixth: the figure's source)
        match = re.match(r"\| `([^`]+)` \| `([^`]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|(?: [^|]+ \|)?$", line)
        if line.startswith("| config | recipe | batch × accumulation |"):
            line = "| config | recipe | batch × accumulation | planned GPU (GiB) | host (GiB) | source |"
        elif line.startswith("|---|---|---|---|---|"):
            line = "|---|---|---|---:|---:|---|"
        elif match and match.group(1) in results:
            r = results[match.group(1)]
            ranks = r.get("world_size", 1)
            figure = f"{device_total(r) / GIB:.1f}" + (f" per GPU ({ranks} GPUs)" if ranks > 1 else "")
            batch = f"{r['batch']['batch_size']} × {r['batch']['accumulation']}"
            line = (f"| `{match.group(1)}` | `{match.group(2)}` | {batch} | "
                    f"{figure} | {r['host_peak_bytes'] / GIB:.1f} | `mtune plan` |")
        elif match:
            raise SystemExit(f"{match.group(1)}: no plan in {RESULTS}; plan it first: "
                             f"python benchmarks/plan_configs.py {match.group(1)}")
        out.append(line)
    return "\n".join(out) + "\n"


COST_SINGLE = "| config | planned GPU (GiB) | plan time (s) | planner peak RSS (GiB) | load average while planned |"
COST_DISTRIBUTED = "| config | ranks | planned GPU per rank (GiB) | plan time (s) | planner peak RSS (GiB) |"
PEAK_RSS = re.compile(r"Every plan's peak resident memory is at most [\d.]+ GiB \(`?[\w/.]+`?, the largest in the\nfile;")


def rendered_costs(results: dict[str, dict]) -> str:
    """docs/plan.md's text with its cost-of-planning rows (their configs as listed) rendered from ``results``: the
    GPU figure, the planning time and peak RSS, and for single-device rows the load average and date; the sentence
    after the tables names the largest peak RSS of the file."""
    text = (REPO / "docs" / "plan.md").read_text()
    out, table = [], None
    for line in text.splitlines():
        if line.startswith(("| config | planned GPU (GiB) | plan time (s)", "| config | ranks | planned GPU per rank")):
            table = "single" if "| ranks |" not in line else "distributed"
            line = COST_SINGLE.replace("while planned |", "while planned | date |") if table == "single" else line
        elif table == "single" and line.startswith("|---|"):
            line = "|---|---:|---:|---:|---:|---|"
        elif table and line.startswith("| `"):
            name = line.split("`")[1]
            if name not in results:
                raise SystemExit(f"{name}: no plan in {RESULTS}; plan it first: python benchmarks/plan_configs.py {name}")
            r = results[name]
            gpu, rss = f"{device_total(r) / GIB:.1f}", f"{r['peak_rss_bytes'] / GIB:.2f}"
            if table == "single":
                machine = r["machine"]
                line = (f"| `{name}` | {gpu} | {r['seconds']:.0f} | {rss} | {machine['load_average']:.1f} | "
                        f"{machine['date']} |")
            else:
                line = f"| `{name}` | {r.get('world_size', 1)} | {gpu} | {r['seconds']:.0f} | {rss} |"
        elif not line.startswith("|"):
            table = None
        out.append(line)
    text = "\n".join(out) + "\n"
    largest = max(results.values(), key=lambda r: r["peak_rss_bytes"])
    sentence = (f"Every plan's peak resident memory is at most {largest['peak_rss_bytes'] / GIB:.2f} GiB "
                f"(`{largest['config']}`, the largest in the\nfile;")
    if not PEAK_RSS.search(text):
        raise SystemExit("docs/plan.md: the sentence on the largest planner RSS is gone; render_plan_figures.py writes it")
    return PEAK_RSS.sub(sentence, text)


def load_results() -> dict[str, dict]:
    return {r["config"]: r for r in json.loads(RESULTS.read_text())["results"]}


def main() -> None:
    if "--list" in sys.argv:
        print(" ".join(shipped_training_configs()))
        return
    results = load_results()
    for config, result in results.items():
        if (CONFIGS / f"{config}.yaml").exists():
            (CONFIGS / f"{config}.yaml").write_text(rendered_header(config, result))
    (REPO / "docs" / "configs.md").write_text(rendered_table(results))
    (REPO / "docs" / "plan.md").write_text(rendered_costs(results))
    print(f"wrote {len(results)} configs' figures")


if __name__ == "__main__":
    main()
