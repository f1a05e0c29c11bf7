#!/usr/bin/env bash
# Triton 3.7.1 for the lent GPU machine, small enough to travel in one call, for flash-linear-attention's kernels on
# a Hopper GPU: fla-core 0.6.0 refuses the machine's Triton 3.6.0 there (its issue #640), and the wheel (188.6 MiB)
# is three times what a call carries (64 MiB, the working tree included).
#
# The wheel is unpacked as pip would install it, less what neither fla's kernels nor their compilation on a Hopper
# GPU load (the Proton profiler and its CUPTI libraries, the Blackwell ptxas, the SASS disassemblers nvdisasm and
# cuobjdump, the optional MLIR plugins, test libraries and tools), with libtriton.so's debug information and local
# symbols stripped (`strip --strip-unneeded`, as distributions ship shared libraries: the code and the dynamic
# symbols Python loads stay; the sizes before and after are in the results file), packed as one .tar.xz. Into
# .whl_triton/ (ignored by git; never commit it): triton.tar.xz, its sha256 (SHA256) and the Triton version
# (VERSION); the sizes into benchmarks/results/gpu_triton.json. The script fails when the archive, with the working
# tree and the rest of the call's carry (.whl/fla, .whl/base), would pass what one call carries.
#
#   scripts/gpu_triton.sh                      # here, where pip reaches PyPI (about 4 minutes: xz -9)
#   PYTHON_VERSION=3.11 scripts/gpu_triton.sh  # the same for this machine's Python, to try it here
#
# The call that runs fla's rows carries .whl_triton, checks the archive and unpacks it into a directory of its own
# (docs/benchmarks.md, "What is left for a GPU", item 1; scripts/gpu_lease.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl_triton
VERSION=3.7.1
CARRY_MIB=64                                       # what one device call carries, the working tree included
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"           # the GPU machine's
command -v strip >/dev/null || { echo "strip (binutils) is needed to pack Triton small enough" >&2; exit 1; }
rm -rf "$OUT"
mkdir -p "$OUT"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$STAGE" "triton==$VERSION"
python3 -m zipfile -e "$STAGE"/triton-*.whl "$STAGE/site"
T="$STAGE/site/triton"
rm -rf "$T/backends/nvidia/lib/cupti" "$T/_C/libproton.so" "$T/instrumentation/libGPUInstrumentationTestLib.so" \
    "$T/backends/nvidia/bin/ptxas-blackwell" "$T/backends/nvidia/bin/nvdisasm" "$T/backends/nvidia/bin/cuobjdump" \
    "$T/plugins" "$T/FileCheck"
stat -c %s "$T/_C/libtriton.so" > "$STAGE/libtriton_bytes"
strip --strip-unneeded "$T/_C/libtriton.so"
chmod +x "$T"/backends/nvidia/bin/*  # zipfile drops the executable bits pip would keep
tar -C "$STAGE/site" -cf - . | xz -T0 -9 > "$OUT/triton.tar.xz"
sha256sum "$OUT/triton.tar.xz" | cut -d' ' -f1 > "$OUT/SHA256"
echo "$VERSION" > "$OUT/VERSION"
ls -l "$OUT"
# the call's carry: this archive, fla-core and mtune's base wheels (scripts/gpu_wheels.sh), the tracked tree
python3 - "$STAGE" "$OUT" "$PYTHON_VERSION" "$CARRY_MIB" <<'PY'
import datetime, json, pathlib, subprocess, sys
stage, out = map(pathlib.Path, sys.argv[1:3])
python_version, carry_mib = sys.argv[3], int(sys.argv[4])
size = lambda path: sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
tree = sum(pathlib.Path(f).stat().st_size for f in subprocess.run(
    ["git", "ls-files", "-z"], capture_output=True, text=True, check=True).stdout.split("\0") if f)
wheels = {d: size(pathlib.Path(d)) if pathlib.Path(d).is_dir() else None for d in (".whl/fla", ".whl/base")}
archive = (out / "triton.tar.xz").stat().st_size
if None in wheels.values():
    sys.exit("run scripts/gpu_wheels.sh first: the fla call carries .whl/fla and .whl/base beside this archive")
call = tree + archive + sum(wheels.values())
print(f"the fla call carries {call / 2**20:.1f} MiB: tree {tree / 2**20:.1f}, Triton {archive / 2**20:.1f}, "
      + ", ".join(f"{d} {b / 2**20:.1f}" for d, b in wheels.items()) + f" (at most {carry_mib})")
if call > (carry_mib - 4) * 2**20:  # 4 MiB for untracked files and the tree's growth
    sys.exit(f"too large for one call: {call / 2**20:.1f} MiB with 4 MiB to spare, of {carry_mib}")
if python_version == "3.12":  # what was packed, for docs/benchmarks.md (the GPU machine's Python only)
    wheel = next(stage.glob("triton-*.whl"))
    record = {"date": datetime.date.today().isoformat(), "wheel": wheel.name, "wheel_bytes": wheel.stat().st_size,
              "libtriton_bytes": {"as_shipped": int((stage / "libtriton_bytes").read_text()),
                                  "stripped": (stage / "site/triton/_C/libtriton.so").stat().st_size},
              "unpacked_bytes": size(stage / "site"), "archive_bytes": archive, "sha256": (out / "SHA256").read_text().strip(),
              "call_carry_bytes": {"tracked_tree": tree, "triton": archive, **wheels}}
    pathlib.Path("benchmarks/results/gpu_triton.json").write_text(json.dumps(record, indent=1) + "\n")
PY
