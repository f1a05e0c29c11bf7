"""fp8 weight storage with upcast at compute: codes and row scales, their bytes, and an autograd function that keeps
only the fp8 codes for backward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtune.modules.fp8_linear import FrozenFp8Linear, dequantize_fp8, fp8_linear, quantize_fp8, stored_weight

W = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64).unsqueeze(1)


@pytest.mark.parametrize("dtype,mantissa_bits,rel_l2", [(torch.float8_e4m3fn, 3, 0.035), (torch.float8_e5m2, 2, 0.065)])
def test_row_scaled_round_trip(dtype, mantissa_bits, rel_l2):
    codes, scale = quantize_fp8(W, dtype)
    assert codes.dtype == dtype and codes.shape == W.shape and scale.shape == (64, 1) and scale.dtype == torch.float32
    back = dequantize_fp8(codes, scale, torch.float32)
    # each row's largest value maps to the format's largest code, so rows 10^4 apart in size keep their precision
    torch.testing.assert_close(back.abs().amax(1), W.abs().amax(1), rtol=1e-6, atol=0)
    normal = W.abs() >= scale * torch.finfo(dtype).smallest_normal
    assert ((back - W).abs() <= W.abs() * 2.0 ** -(mantissa_bits + 1) * 1.0001)[normal].all()  # half an ulp
    row_error = (back - W).norm(dim=1) / W.norm(dim=1)
    assert row_error.max() < rel_l2  # measured worst rows: e4m3 0.031, e5m2 0.057
    zeros, zscale = quantize_fp8(torch.zeros(2, 8), dtype)
    assert torch.equal(dequantize_fp8(zeros, zscale, torch.float32), torch.zeros(2, 8))  # an all-zero row: no NaN


@pytest.mark.parametrize("model_dtype,ratio", [(torch.bfloat16, 0.5), (torch.float32, 0.25)])
def test_stored_bytes_are_half_of_bf16_and_a_quarter_of_fp32_plus_scales(model_dtype, ratio):
    linear = FrozenFp8Linear.from_linear(nn.Linear(256, 512, bias=False, dtype=model_dtype), torch.float8_e4m3fn)
    weight_bytes = linear.weight.numel() * linear.weight.element_size()
    scale_bytes = linear.weight_scale.numel() * linear.weight_scale.element_size()
    assert weight_bytes == ratio * 512 * 256 * torch.finfo(model_dtype).bits // 8
    assert scale_bytes == 4 * 512  # one fp32 per output row: 4 / in_features extra bytes per value
    assert set(linear.state_dict()) == {"weight"}  # the scales are not a checkpoint key
    assert stored_weight(linear).dtype == model_dtype


def test_forward_and_backward_equal_the_upcast_weight_and_save_no_upcast_copy():
    codes, scale = quantize_fp8(W, torch.float8_e4m3fn)
    upcast = dequantize_fp8(codes, scale, torch.float32)
    x = torch.randn(4, 8, 128, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fp8_linear(x, codes, scale)
    assert torch.equal(out, F.linear(x, upcast))
    # backward keeps the 1-byte codes and the scales, never a full-precision weight
    assert {(t.dtype, tuple(t.shape)) for t in saved} == {(torch.float8_e4m3fn, (64, 128)), (torch.float32, (64, 1))}
    grad = torch.randn_like(out)
    out.backward(grad)
    expected, = torch.autograd.grad(F.linear(x, upcast), x, grad)
    assert torch.equal(x.grad, expected)


def test_loading_a_full_precision_weight_into_a_stored_module_quantizes_it():
    plain = nn.Linear(128, 64, bias=True)
    stored = FrozenFp8Linear.from_linear(nn.Linear(128, 64, bias=True), torch.float8_e4m3fn)
    stored.load_state_dict(plain.state_dict())
    codes, scale = quantize_fp8(plain.weight, torch.float8_e4m3fn)
    assert torch.equal(stored.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(stored.weight_scale, scale)
    x = torch.randn(3, 128)
    assert torch.equal(stored(x), F.linear(x, dequantize_fp8(codes, scale, torch.float32), plain.bias))
