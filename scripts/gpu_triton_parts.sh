#!/usr/bin/env bash
# Triton 3.7.1 for the lent GPU machine, in parts small enough to ride along with the lease's first calls, for
# flash-linear-attention's kernels on a Hopper GPU: fla-core 0.6.0 refuses the machine's Triton 3.6.0 there (its
# issue #640), and the wheel (188.6 MiB) is more than a call carries (64 MiB, the working tree's 11 MiB included).
#
# The wheel is unpacked as pip would install it, less what neither fla's kernels nor their compilation on a Hopper
# GPU load (the Proton profiler and its CUPTI libraries, the Blackwell ptxas, test libraries and tools), and packed
# again as one .tar.xz, split into parts of PART_MIB (32) MiB: 87 MiB, so three parts, the first small enough
# to travel beside .whl (18 MiB) in the lease's first call. Into .whl_triton/ (ignored by git; never commit it):
# part_aa, part_ab, ..., the archive's sha256 (SHA256) and the Triton version (VERSION); the sizes into
# benchmarks/results/gpu_triton_parts.json.
#
#   scripts/gpu_triton_parts.sh                     # here, where pip reaches PyPI (about 3 minutes: xz -9)
#   PYTHON_VERSION=3.11 scripts/gpu_triton_parts.sh # the same for this machine's Python, to try it here
#
# A warm GPU machine keeps /tmp between calls, so the parts are appended there one call at a time and the archive
# is checked and unpacked into a directory of its own in the call that runs fla's rows (docs/benchmarks.md, "What
# is left for a GPU", gives the calls).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl_triton
VERSION=3.7.1
PART_MIB="${PART_MIB:-32}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"  # the GPU machine's
rm -rf "$OUT"
mkdir -p "$OUT"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$STAGE" "triton==$VERSION"
python3 -m zipfile -e "$STAGE"/triton-*.whl "$STAGE/site"
rm -rf "$STAGE/site/triton/backends/nvidia/lib/cupti" "$STAGE/site/triton/_C/libproton.so" \
    "$STAGE/site/triton/instrumentation/libGPUInstrumentationTestLib.so" \
    "$STAGE/site/triton/backends/nvidia/bin/ptxas-blackwell" \
    "$STAGE/site/triton/plugins/libTritonPluginsTestLib.so" "$STAGE/site/triton/FileCheck"
chmod +x "$STAGE"/site/triton/backends/nvidia/bin/*  # zipfile drops the executable bits pip would keep
tar -C "$STAGE/site" -cf - . | xz -T0 -9 > "$STAGE/triton.tar.xz"
sha256sum "$STAGE/triton.tar.xz" | cut -d' ' -f1 > "$OUT/SHA256"
echo "$VERSION" > "$OUT/VERSION"
split -b "${PART_MIB}M" "$STAGE/triton.tar.xz" "$OUT/part_"
ls -l "$OUT"
# what was packed, for docs/benchmarks.md (the GPU machine's Python only: a try here writes nothing)
if [ "$PYTHON_VERSION" = 3.12 ]; then python3 - "$STAGE" "$OUT" <<'PY'
import datetime, json, pathlib, sys
stage, out = map(pathlib.Path, sys.argv[1:])
wheel = next(stage.glob("triton-*.whl"))
record = {"date": datetime.date.today().isoformat(), "wheel": wheel.name, "wheel_bytes": wheel.stat().st_size,
          "archive_bytes": (stage / "triton.tar.xz").stat().st_size,
          "parts_bytes": {p.name: p.stat().st_size for p in sorted(out.glob("part_*"))},
          "sha256": (out / "SHA256").read_text().strip()}
pathlib.Path("benchmarks/results/gpu_triton_parts.json").write_text(json.dumps(record, indent=1) + "\n")
PY
fi
