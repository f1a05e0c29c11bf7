"""mtune: PyTorch-native fine-tuning recipes for large language models."""

import logging

__version__ = "0.1.0"


class _LibraryNoise(logging.Filter):
    """Drop two import-time messages of dependencies that say nothing actionable to a user: torchao's attempt to
    load its CUDA-only kernels on a CPU build, and torch's note on torchao registering Enum types for compile."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name.startswith("torchao") and message.startswith("Failed to load") and "_C_" in message:
            import torch

            return torch.cuda.is_available()  # on a GPU machine a failed kernel load matters: keep it
        return "register_constant() on Enum subclasses is deprecated" not in message


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_LibraryNoise())
