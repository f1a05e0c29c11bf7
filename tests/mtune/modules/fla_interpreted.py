"""GatedDeltaNet through flash-linear-attention's own Triton kernel, run by Triton's interpreter on the CPU, against
the PyTorch chunked form: prints one JSON object, ``{case: {tensor: max |kernel - pytorch| / max |pytorch|}}``.

Run in its own process with ``TRITON_INTERPRET=1`` set before Triton is imported (Triton reads it when the kernels
are defined), by ``test_gated_deltanet.py``. Two things the interpreter lacks are supplied here, neither touching
the arithmetic: the autotuner's timing (there is no GPU to time configurations on: the first one runs), and
``.to(dtype)`` on a kernel loop's index (compiled Triton makes ``range``'s index a tensor; the interpreter leaves it
a Python int).
"""

import builtins
import json
import sys

import torch
import triton.language as tl
import triton.runtime.autotuner as autotuner


class _LoopIndex(int):
    """A kernel loop's index as the interpreter yields it (an int), with the cast compiled Triton offers."""

    def to(self, dtype):
        return tl.cast(int(self), dtype)


def _loop_range(*args):
    return map(_LoopIndex, builtins.range(*args))


def main() -> None:
    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops"):
            module.range = _loop_range

    from mtune.modules import gated_deltanet
    from mtune.modules.gated_deltanet import GatedDeltaNet
    from mtune.modules.packed_attention import Segments

    torch.manual_seed(0)
    # grouped value heads (2 query/key heads, 4 value heads), as Qwen3.5's layers have them
    layer = GatedDeltaNet(dim=64, n_k_heads=2, n_v_heads=4, k_head_dim=32, v_head_dim=32)
    x = torch.randn(2, 80, 64, requires_grad=True)
    segments = Segments(torch.tensor([0, 13, 80, 117, 160], dtype=torch.int32), 80)  # rows: 13 + 67, 37 + 43 tokens
    weight = torch.randn(2, 80, 64)

    def run(**kwargs) -> dict[str, torch.Tensor]:
        x.grad = None
        layer.zero_grad()
        out = layer(x, **kwargs)
        (out * weight).sum().backward()
        return {"out": out.detach(), "x.grad": x.grad.clone(),
                **{f"{n}.grad": p.grad.clone() for n, p in layer.named_parameters()}}

    cases = {"rows": {}, "packed": {"segments": segments}}
    pytorch = {case: run(**kwargs) for case, kwargs in cases.items()}
    gated_deltanet.fla_kernel = lambda x: chunk_gated_delta_rule
    kernel = {case: run(**kwargs) for case, kwargs in cases.items()}
    print(json.dumps({case: {name: ((kernel[case][name] - ref).abs().max() / ref.abs().max()).item()
                             for name, ref in pytorch[case].items()} for case in cases}))


if __name__ == "__main__":
    main()
