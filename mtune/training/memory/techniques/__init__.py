"""One module per memory technique, each a `mtune.training.memory.technique.MemoryTechnique` that declares
everything about itself (keys, rules, application, resume, ``--fit`` choices, cost, out-of-memory advice). Pure
Python at import: ``mtune validate`` reads them without torch. The order they are applied in is
`mtune.training.memory.registry.TECHNIQUES`."""
