"""flash-linear-attention's gated delta rule kernel for :class:`~mtune.modules.gated_deltanet.GatedDeltaNet` on CUDA.

The kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, Triton) is used only when the package imports
and a small gated forward and backward runs on the device: flash-linear-attention refuses some GPU and Triton
pairs only in backward (Hopper GPUs with Triton 3.4 to 3.7.0, its issue #640), which would otherwise end the first
training step in a traceback. Where either fails, the PyTorch chunked form runs and the run's log says why
(:func:`recurrence_runs`).

``mtune plan`` runs the model on fake tensors, where the kernel cannot run: when the run will use the kernel
(:func:`planned_recurrence`), the plan runs :func:`~mtune.modules.gated_deltanet_fla_plan.fla_stand_in` instead,
which allocates what the kernel allocates (:func:`~mtune.modules.gated_deltanet.planning_recurrence`); otherwise
the PyTorch form is planned.
"""

import importlib
import os

import torch
from torch._subclasses.fake_tensor import is_fake

from mtune.errors import MtuneError

FLA_MODULE = "fla.ops.gated_delta_rule"
PROBE_SHAPE = (1, 64, 1, 64)
"""``[b, s, heads, head_dim]`` of the probe's queries, keys and values: one chunk of one head."""

_fla_rule = None  # chunk_gated_delta_rule once imported and probed; False: not importable, or its probe failed
_fla_refusal = "pip install flash-linear-attention for its CUDA kernels"  # why not, when _fla_rule is False

KERNEL_RUNS = "flash-linear-attention's chunk_gated_delta_rule"
""":func:`recurrence_runs`'s answer where the kernel runs."""


class PlanSettingError(MtuneError, ValueError):
    """A planning setting of the environment that mtune cannot read (the message names the variable)."""


PLAN_ENV = "MTUNE_PLAN_GATED_DELTA_RULE"
"""Environment variable: which recurrence ``mtune plan`` counts for a CUDA target's Gated DeltaNet layers: ``fla``
(flash-linear-attention's kernel, e.g. planning a GPU machine's run on a laptop), ``pytorch`` (the chunked form),
or ``auto`` (the default: the kernel where this machine's CUDA device imports and passes the probe, else the
PyTorch form, which plans more bytes)."""


def _fla_import(device: torch.device | str = "cuda"):
    """The kernel, imported and probed on ``device`` on the first call; None where the PyTorch form runs."""
    global _fla_rule, _fla_refusal
    if _fla_rule is None:
        try:
            kernel = importlib.import_module(FLA_MODULE).chunk_gated_delta_rule
        except ImportError:  # not installed, or Triton is not
            _fla_rule = False
        else:
            # on real tensors even when first asked under a dispatch mode (the planner's fake tensors, the byte
            # tracker): a Triton kernel cannot run on fake ones, and the refusal would stay for the run itself
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                _fla_refusal = fla_probe(kernel, device)
            _fla_rule = False if _fla_refusal else kernel
    return _fla_rule or None


def fla_probe(kernel, device: torch.device | str) -> str:
    """Why ``kernel`` cannot train on ``device`` (its error's first line), or "" when a gated forward and backward
    of :data:`PROBE_SHAPE` in bf16 runs there."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(PROBE_SHAPE, generator=generator).to(device, torch.bfloat16).requires_grad_()
               for _ in range(3))
    g = -torch.rand(PROBE_SHAPE[:3], generator=generator).to(device)  # log decays, fp32 as GatedDeltaNet's
    beta = torch.rand(PROBE_SHAPE[:3], generator=generator).to(device, torch.bfloat16)
    try:
        with torch.enable_grad():
            fla_gated_delta_rule(kernel, q, k, v, g, beta, None).float().sum().backward()
    except Exception as error:  # the kernel's refusal or a Triton failure: either way it cannot train here
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"flash-linear-attention is installed but its kernel failed a gated forward and backward: {first_line}"
    return ""


def fla_kernel(x: torch.Tensor):
    """flash-linear-attention's ``chunk_gated_delta_rule`` for a real CUDA tensor ``x`` when the package (and
    Triton) import and its probe passed, else None: the PyTorch form runs. A module global, not a cache wrapper, so
    that torch.compile traces an attribute read."""
    if x.device.type != "cuda" or is_fake(x):
        return None
    return _fla_import(x.device)


def planned_recurrence(target: torch.device | str) -> str:
    """``"fla"`` or ``"pytorch"``: the recurrence a plan for a run on ``target`` counts (see :data:`PLAN_ENV`)."""
    choice = os.environ.get(PLAN_ENV, "auto")
    if choice not in ("auto", "fla", "pytorch"):
        raise PlanSettingError(f"environment variable {PLAN_ENV}={choice!r}: use fla, pytorch or auto")
    target = torch.device(target)
    if target.type != "cuda":  # the kernel runs on CUDA only
        return "pytorch"
    if choice != "auto":
        return choice
    if not torch.cuda.is_available():
        return "pytorch"
    return "fla" if _fla_import(target) is not None else "pytorch"


def recurrence_runs(device: torch.device | str) -> str:
    """What the Gated DeltaNet recurrence runs on ``device``, for the run's log (probing the kernel there first)."""
    if torch.device(device).type != "cuda":
        return "the PyTorch chunked form"
    if _fla_import(device) is None:
        return f"the PyTorch chunked form ({_fla_refusal})"
    return KERNEL_RUNS


def fla_gated_delta_rule(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The rule through flash-linear-attention's kernel: ``q, k`` ``[b, s, k_heads, k_head_dim]`` before their
    normalisation (the kernel L2-normalises both and scales ``q`` by ``k_head_dim ** -0.5``), ``v`` ``[b, s,
    v_heads, v_head_dim]``, ``g`` and ``beta`` ``[b, s, v_heads]``; ``cu_seqlens`` (int ``[n + 1]``, document
    starts in the flattened ``b * s`` tokens): each document from a zero state, the kernel's variable-length form
    on one flattened row. Returns ``[b, s, v_heads, v_head_dim]`` in ``v``'s dtype."""
    b, s = q.shape[:2]
    if cu_seqlens is None:
        out, _ = kernel(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True)
        return out
    flat = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out, _ = kernel(*flat, scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
    return out.reshape(b, s, *out.shape[2:])
