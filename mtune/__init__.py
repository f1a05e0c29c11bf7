"""mtune: PyTorch-native fine-tuning recipes for large language models."""

__version__ = "0.1.0"
