"""Tiled MLP against the untiled one (the oracle): logits, every gradient, hook and dequantization counts."""

import pytest
import torch
from torch import nn

from mtune.models import build_model
from mtune.modules.feed_forward import FeedForward
from mtune.modules.lora import apply_lora
from mtune.modules.nf4_linear import _nf4_api
from mtune.modules.tiled_mlp import apply_tiled_mlp, mlp_tiles
from tests._helpers.training import LargestTensor

MLP = ["gate_proj", "up_proj", "down_proj"]


def tiny(method):
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu")
    if method != "full":
        apply_lora(model, ["q_proj", "v_proj", *MLP], rank=8, alpha=16, use_dora=method == "dora",
                   quantize_base=method == "qlora")
        with torch.no_grad():  # B off zero, so A's gradient is not zero
            for name, param in model.named_parameters():
                if name.endswith("lora_b.weight"):
                    param.normal_(0, 0.05)
    return model


def step(model, tokens):
    model.zero_grad()
    logits = model(tokens)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_round_off(actual, expected, name, scale=1e-5):
    error = (actual - expected).abs().max().item()
    assert error <= scale * expected.abs().max().item(), f"{name}: max error {error}"


def assert_tiling_changes_nothing(model, tokens, tiles=3):
    ref, ref_grads = step(model, tokens)
    apply_tiled_mlp(model, tiles)
    out, grads = step(model, tokens)
    assert_round_off(out, ref, "logits")  # not bitwise: matmul blocking depends on the tile's row count
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        assert_round_off(grad, ref_grads[name], name)


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "dora"])
def test_gradients_equal_untiled(method):
    assert_tiling_changes_nothing(tiny(method), torch.randint(0, 512, (2, 37)))


def test_with_activation_checkpointing():
    from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing

    model = apply_activation_checkpointing(tiny("lora"))
    assert_tiling_changes_nothing(model, torch.randint(0, 512, (1, 40)), tiles=4)


def test_lora_dropout_masks_are_replayed_in_backward():
    """With LoRA dropout (p=0.5) active, backward recomputes each tile under the RNG state forward started from,
    so the gradients are those of the masks forward drew. The oracle: the same seed, the plain MLP called tile by
    tile (the same draws in the same order) with ordinary autograd.

    Mutation checked: ``ctx.rng = None`` in ``_TiledMLP.forward`` (no replay: backward draws fresh masks) fails
    the gradient comparison (the forward outputs still agree)."""
    from mtune.modules.tiled_mlp import _tiled_forward

    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu")
    apply_lora(model, MLP, rank=8, alpha=16, dropout=0.5)
    mlp = model.layers[0].mlp
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            if name.endswith("lora_b.weight"):
                param.normal_(0, 0.05)
    x = torch.randn(2, 9, model.layers[0].mlp.gate_proj.in_features)
    weight = torch.randn(2, 9, mlp.down_proj.out_features)
    params = [p for p in mlp.parameters() if p.requires_grad]

    def grads_of(forward):
        torch.manual_seed(1)
        xs = x.clone().requires_grad_()
        out = forward(xs)
        (out * weight).sum().backward()
        result = [xs.grad] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out.detach(), result

    def by_tiles(xs):  # 18 rows over 3 tiles of 6, as _tile_bounds splits them
        flat = xs.reshape(-1, xs.shape[-1])
        return torch.cat([FeedForward.forward(mlp, flat[i:i + 6]) for i in (0, 6, 12)]).view(2, 9, -1)

    ref_out, ref_grads = grads_of(by_tiles)
    out, grads = grads_of(lambda xs: _tiled_forward(mlp, 3, xs))
    assert_round_off(out, ref_out, "output")
    for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
        assert_round_off(grad, ref, f"gradient {i}")


def test_tiles_one_restores_the_plain_forward():
    model = apply_tiled_mlp(tiny("lora"), 4)
    mlp = model.layers[0].mlp
    assert mlp_tiles(mlp) == 4 and "forward" in vars(mlp)
    apply_tiled_mlp(model, 1)
    assert mlp_tiles(mlp) == 1 and "forward" not in vars(mlp)


class CountNF4Dequantize:
    """Counts NF4 dequantizations (``get_original_weight``) while active."""

    def __enter__(self):
        self.cls = _nf4_api().NF4Tensor
        self.original = self.cls.get_original_weight
        self.calls = 0

        def counting(weight):
            self.calls += 1
            return self.original(weight)

        self.cls.get_original_weight = counting
        return self

    def __exit__(self, *exc):
        self.cls.get_original_weight = self.original


def test_qlora_dequantizes_and_runs_hooks_once_per_pass_not_per_tile():
    model = tiny("qlora")
    tokens = torch.randint(0, 512, (1, 64))
    hooks = {"calls": 0}
    for layer in model.layers:
        for name in MLP:
            getattr(layer.mlp, name).register_forward_pre_hook(lambda m, args: hooks.update(calls=hooks["calls"] + 1))
    counts = {}
    for tiles in (1, 8):
        apply_tiled_mlp(model, tiles)
        hooks["calls"] = 0
        with CountNF4Dequantize() as dequantized:
            step(model, tokens)
        counts[tiles] = (hooks["calls"], dequantized.calls)
    n = len(model.layers) * 3  # MLP projections
    # untiled: hooks once (forward); NF4 linear dequantizes in forward and backward, plus the other NF4 linears
    # (k_proj, o_proj) that are not part of the MLP.
    mlp_dequantized = 2 * n
    assert counts[1][0] == n
    assert counts[8] == (2 * n, counts[1][1])  # hooks: forward + backward; the same dequantizations as untiled
    assert counts[1][1] >= mlp_dequantized


def test_weight_offloading_leaf_level_moves_each_weight_once_per_pass():
    from mtune.training.memory.techniques.weight_offloading import WeightOffloading
    from mtune.training.placement import Placement
    from mtune.training.memory.techniques.weight_offloading.offloader import apply_weight_offloading

    tokens = torch.randint(0, 512, (1, 48))
    ref, ref_grads = step(tiny("lora"), tokens)
    copied = {}
    for tiles in (1, 6):
        model = tiny("lora")
        apply_tiled_mlp(model, tiles)
        offloader = apply_weight_offloading(model, WeightOffloading(type="leaf_level", blocks_per_group=1,
                                                                    use_streams=False),
                                            Placement("cpu", distinct=True))
        offloader.offload()
        out, grads = step(model, tokens)
        assert_round_off(out, ref, "logits")
        for name, grad in grads.items():
            assert_round_off(grad, ref_grads[name], name)
        copied[tiles] = offloader.copies_to_compute
    assert copied[6] == copied[1]  # each group comes in once per pass, as untiled (not once per tile)



def test_intermediates_exist_one_tile_at_a_time():
    mlp = FeedForward(64, 256)
    x = torch.randn(2, 100, 64, requires_grad=True)
    largest = {}
    for tiles in (1, 8):
        apply_tiled_mlp(nn.Sequential(mlp), tiles)
        with LargestTensor() as seen:
            mlp(x).sum().backward()
        largest[tiles] = seen.largest
    assert largest[1] == 200 * 256  # [tokens, hidden]
    assert largest[8] == max(200 * 64, 25 * 256, 256 * 64)  # the input / output, a tile's hidden, a weight


def test_a_tile_count_below_one_is_refused():
    """0 tiles (or a fraction) is an error, not a silent untiled MLP."""
    model = nn.Sequential(FeedForward(8, 16))
    for tiles in (0, -2, 2.5):
        with pytest.raises(ValueError, match="mlp tiles must be an int >= 1 or 'auto'"):
            apply_tiled_mlp(model, tiles)


def test_backward_recomputes_under_the_forward_s_autocast():
    """Under bf16 autocast each tile's recompute in backward runs its matmuls in bf16, as the untiled backward does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):  # the dtypes of every matmul's output while active
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.dtypes.add(out.dtype)
            return out

    torch.manual_seed(0)
    seen = {}
    for tiles in (1, 3):
        mlp = apply_tiled_mlp(nn.Sequential(FeedForward(8, 16)), tiles)
        x = torch.randn(2, 9, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x)
        with MatmulDtypes() as mode:
            y.float().square().sum().backward()
        seen[tiles] = mode.dtypes
    assert seen[1] == {torch.bfloat16} and seen[3] == {torch.bfloat16}
