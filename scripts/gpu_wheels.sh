#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, for benchmarks/gpu_suite.py, into .whl/ (ignored by git; never commit them).
#
#   scripts/gpu_wheels.sh            # here, where pip reaches PyPI; prints each wheel's size and the total
#
# The GPU machine (x86-64, Python 3.12, torch 2.11.0+cu130, no network) has torch, transformers, safetensors,
# sentencepiece, tiktoken, tokenizers, huggingface_hub, pyarrow, matplotlib, numpy, pandas, psutil, Pillow.
#   .whl/base/       what every mtune run imports: omegaconf 2.4.0 + antlr4-python3-runtime 4.13.2 (enough for the
#                    fla call, which carries Triton beside it and has no room for the rest)
#   .whl/            the rest of mtune's: torchao 0.18.0 (the release built for torch 2.11), bitsandbytes 0.50.2 (its
#                    CUDA 13.0 and CPU libraries only: the full wheel is 43 MB of libraries for other CUDA and ROCm
#                    versions)
#   .whl/torchtune/  torchtune 0.6.1's, installed into a second directory because it imports
#                    torchao.dtypes.nf4tensor, which torchao 0.18 no longer has: torchao 0.11.0 (its Python only:
#                    its C++ extensions were built for torch 2.7 and are skipped), torchdata 0.11.0, datasets 5.2.0
#                    with dill 0.4.1 and multiprocess 0.70.19, kagglehub, blobfile, pycryptodomex
#   .whl/fla/        fla-core 0.6.0 (flash-linear-attention's Triton kernels), in a directory of its own so that only
#                    the cases that ask for it (gpu_suite's --fla-path) import it: their twins run the PyTorch form
# Everything travels with the working tree: 64 MiB in all (this script checks the wheels stay under 32 MiB).
# On the machine (docs/benchmarks.md, "GPU suite"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl .whl/base/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_tt \
#       .whl/torchtune/*.whl
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_fla \
#       .whl/fla/*.whl
#   export PYTHONPATH=/tmp/site
#   python3 benchmarks/gpu_suite.py --part 1 --torchtune-path /tmp/site_tt:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl
rm -rf "$OUT"
mkdir -p "$OUT/base" "$OUT/torchtune" "$OUT/fla"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # download DIR NAME==VERSION ...
    local dir=$1; shift
    python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$dir" "$@"
}
download "$OUT/base" omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
download "$OUT" torchao==0.18.0 bitsandbytes==0.50.2
download "$OUT/fla" fla-core==0.6.0   # flash-linear-attention's kernels (Triton, pure Python; einops is there)
download "$OUT/torchtune" torchtune==0.6.1 torchao==0.11.0 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 \
    multiprocess==0.70.19 kagglehub==1.0.3 blobfile==3.3.0 pycryptodomex==3.24.2

# bitsandbytes: keep the CUDA 13.0 library (torch 2.11.0+cu130) and the CPU one; drop the rest and their RECORD lines
python3 - "$OUT"/bitsandbytes-*.whl <<'EOF'
import re, sys, zipfile
from pathlib import Path

path = Path(sys.argv[1])
keep = re.compile(r"libbitsandbytes_(cuda130|cpu)\.so$")
drop = lambda name: re.search(r"libbitsandbytes_\w+\.(so|dll|dylib)$", name) and not keep.search(name)
tmp = path.with_suffix(".tmp")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if drop(info.filename):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not drop(line.split(b",")[0].decode()))
        dst.writestr(info, data)
tmp.replace(path)
EOF

total=0
while IFS= read -r -d '' wheel; do
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    printf '%8.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "${wheel#"$OUT"/}"
done < <(find "$OUT" -type f -name '*.whl' -print0 | sort -z)
printf '%8.2f MiB  in all\n' "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt $((32 * 1048576)) ]; then
    echo "too large to carry beside the working tree (64 MiB per call in all)" >&2
    exit 1
fi
