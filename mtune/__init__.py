"""mtune: PyTorch-native fine-tuning recipes for large language models."""

import logging

__version__ = "0.1.0"


class _LibraryNoise(logging.Filter):
    """Drop three import-time messages of dependencies that say nothing actionable to a user: torchao's attempt to
    load its CUDA-only kernels on a CPU build, torch's note on torchao registering Enum types for compile, and
    bitsandbytes' note that its CPU 4-bit matmul kernel package (`kernels`) is not installed: mtune's NF4 is
    torchao's, and it uses bitsandbytes for 8-bit optimizers only."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name.startswith("torchao") and message.startswith("Failed to load") and "_C_" in message:
            import torch

            return torch.cuda.is_available()  # on a GPU machine a failed kernel load matters: keep it
        if record.name.startswith("bitsandbytes") and message.startswith("Failed to load CPU gemm_4bit_forward"):
            return False
        return "register_constant() on Enum subclasses is deprecated" not in message


for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    logging.getLogger(_name).addFilter(_LibraryNoise())
