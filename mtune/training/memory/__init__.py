"""Memory techniques and their application: the contract (`technique`), one module per technique
(`techniques/`), the registry that orders them and derives the keys and rules (`registry`), the one function that
applies them (`apply`), their implementations (activation checkpointing and offloading, weight and optimizer-state
offloading, fp8 storage, optimizers), training precision and out-of-memory advice."""
