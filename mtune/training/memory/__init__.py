"""Memory techniques and what they act on: the one function that applies them in order (`apply`), activation
checkpointing and offloading, training precision, optimizers (low-bit, paged, in-backward), memory accounting and
out-of-memory advice."""
