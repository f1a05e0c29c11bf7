#!/usr/bin/env bash
# Prints the versions of what the run installed (mtune's dependencies and the test extras), one line, so a CI log
# says what the suite ran against on that machine (and, when scripts/test.sh installed it, the fla oracle's).
python3 - <<'PY'
from importlib.metadata import PackageNotFoundError, version
import platform
names = ["torch", "torchao", "bitsandbytes", "omegaconf", "huggingface-hub", "safetensors", "tokenizers",
         "sentencepiece", "tiktoken", "pyarrow", "matplotlib", "pytest", "transformers", "peft", "tensorboard",
         "wandb", "datasets"]
found = []
for name in names:
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print(f"installed (python {platform.python_version()}): " + ", ".join(found))
PY
if [ -n "${MTUNE_FLA_ORACLE_PATH:-}" ]; then
  PYTHONPATH="$MTUNE_FLA_ORACLE_PATH" python3 -c "from importlib.metadata import version as v
print('the fla oracle\'s own directory: fla-core', v('fla-core'), 'triton', v('triton'))" 2>/dev/null || true
fi
