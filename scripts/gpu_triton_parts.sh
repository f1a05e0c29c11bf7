#!/usr/bin/env bash
# Triton 3.7.1 for the lent GPU machine, in parts that each travel in one device call, for flash-linear-attention's
# kernels on a Hopper GPU: fla-core 0.6.0 refuses the machine's Triton 3.6.0 there (its issue #640), and the wheel
# (188.6 MiB) is more than a call carries (64 MiB, the working tree included). Into .whl_triton/ (ignored by git;
# never commit it): part_aa to part_ad, 48 MiB each but the last, the wheel's file name (NAME) and its sha256 (SHA256).
#
#   scripts/gpu_triton_parts.sh        # here, where pip reaches PyPI
#
# A warm GPU machine keeps /tmp between calls, so the parts are appended there one call at a time and joined, checked
# and installed in the last (docs/benchmarks.md, "What is left for a GPU", gives the calls).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl_triton
rm -rf "$OUT"
mkdir -p "$OUT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$OUT" triton==3.7.1
wheel=$(ls "$OUT"/triton-*.whl)
basename "$wheel" > "$OUT/NAME"
sha256sum "$wheel" | cut -d' ' -f1 > "$OUT/SHA256"
split -b 48M "$wheel" "$OUT/part_"
rm "$wheel"
ls -l "$OUT"
