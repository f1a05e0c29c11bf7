"""Predicting and measuring memory: ``mtune plan`` (`plan`: the recipe's own setup and two steps on fake tensors),
``mtune plan --fit`` (`fit`: the search over the techniques' choices, `cost`: what a candidate costs per token),
and their instruments, which real runs use too (`tracker`: live tensor bytes by category and location, `breakdown`:
per-step peaks for ``plan_check`` and ``memory_breakdown``, `optimizer_layouts`: bitsandbytes' state layouts)."""
