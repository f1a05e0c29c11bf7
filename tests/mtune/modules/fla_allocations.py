"""flash-linear-attention's chunk_gated_delta_rule, run by Triton's interpreter on the CPU under mtune's byte tracker,
against the planner's stand-in (gated_deltanet_fla_plan.py) on fake tensors: prints one JSON object, ``{case:
{"fla": [signed bytes], "fla_peak": bytes, "plan": [...], "plan_peak": bytes}}``, each list the live-byte changes
of forward and backward in order (``+n`` a storage made, ``-n`` one freed).

Run in its own process with ``TRITON_INTERPRET=1`` set before Triton is imported, by ``test_gated_deltanet.py``.
The interpreter's autotuner timing and loop index are supplied as in fla_interpreted.py. One more interpreter
artifact is removed: it copies each kernel argument to the host through a recursive closure (a reference cycle),
which keeps every argument's storage alive until Python's next cycle collection; on a GPU no such copy exists, so
the cycle is collected as each launch returns (automatic collection is off, so nothing else is collected at random
points). Storages of no bytes (the interpreter's) and integer ones (fla's chunk indices of packed rows, int32 and
int64, which the stand-in does not model, and mtune's ``cu_seqlens`` and its ``.long()``, on both sides) are not
counted.
"""

import gc
import json

import torch

from fla_interpreted import _loop_range  # noqa: F401  (run from this directory: the test puts it on the path)


class _Tracker:
    """mtune's tracker, not counting integer storages."""

    def __new__(cls, base, **kwargs):
        class Tracker(base):
            def _add(self, storage, category, sample=None):
                if sample is not None and not sample.dtype.is_floating_point:
                    return
                super()._add(storage, category, sample)

        return Tracker(**kwargs)


def _changes(events) -> list[int]:
    sizes, out = {}, []
    for kind, key, nbytes, _ in events:
        if kind == "alloc" and nbytes:
            sizes[key] = nbytes
            out.append(nbytes)
        elif kind == "free" and key in sizes:
            out.append(-sizes.pop(key))
    return out


def _run(kernel, tracker, b, s, h, hv, dk, dv, packed, make):
    """GatedDeltaNet's call (queries, keys and values split from one convolved [b, s, width] view), forward and
    backward, under ``tracker``; returns (changes, peak)."""
    from mtune.modules.gated_deltanet_fla import fla_gated_delta_rule
    from mtune.training.planning.tracker import device_events

    width = 2 * h * dk + hv * dv
    conv = make(b, width, s, dtype=torch.bfloat16).requires_grad_()
    qkv = conv.transpose(1, 2)
    q, k, v = qkv.split([h * dk, h * dk, hv * dv], dim=-1)
    q, k = (t.reshape(b, s, h, dk) for t in (q, k))
    v = v.reshape(b, s, hv, dv)
    g = make(b, s, hv, dtype=torch.float32).requires_grad_()
    beta = make(b, s, hv, dtype=torch.bfloat16).requires_grad_()
    cu_seqlens = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=conv.device) if packed else None
    grad = make(b, s, hv, dv, dtype=torch.bfloat16)
    for t in (conv, g, beta, grad):
        tracker.track(t, "activations")
    with tracker, device_events() as events:
        tracker.take_interval()
        out = fla_gated_delta_rule(kernel, q, k, v, g, beta, cu_seqlens)
        out.backward(grad)
        del out
    return _changes(events), tracker.take_interval().peak["device"]


CASES = {  # b, s, query/key heads, value heads, key and value head dims, packed
    "rows_grouped": (2, 80, 1, 2, 32, 16, False),
    "packed_grouped": (2, 70, 1, 2, 32, 16, True),
    "rows_one_chunk_k64": (1, 64, 1, 1, 64, 16, False),
}


def main() -> None:
    import triton.runtime.autotuner as autotuner
    from triton.runtime.interpreter import GridExecutor

    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0]
    launch = GridExecutor.__call__

    def launch_and_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    GridExecutor.__call__ = launch_and_collect
    import sys

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops"):
            module.range = _loop_range

    from mtune.modules.gated_deltanet_fla_plan import fla_stand_in
    from mtune.training.planning.fake_mode import PlanningTracker, planner_fake_mode
    from mtune.training.planning.tracker import TensorTracker

    gc.disable()
    results = {}
    for case, (b, s, h, hv, dk, dv, packed) in CASES.items():
        torch.manual_seed(0)
        real = lambda *shape, dtype: torch.rand(*shape).to(dtype)  # noqa: E731
        fla, fla_peak = _run(chunk_gated_delta_rule, _Tracker(TensorTracker), b, s, h, hv, dk, dv, packed, real)
        mode = planner_fake_mode(allow_non_fake_inputs=True)
        with mode:
            fake = lambda *shape, dtype: torch.empty(*shape, dtype=dtype)  # noqa: E731
            # Triton's interpreter: fla cannot query the device's shared memory, so it tiles keys by 32
            plan, plan_peak = _run(fla_stand_in(k_tile=32), _Tracker(PlanningTracker, fake_mode=mode), b, s, h, hv,
                                   dk, dv, packed, fake)
        results[case] = {"fla": fla, "fla_peak": fla_peak, "plan": plan, "plan_peak": plan_peak}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
