"""NF4 dequantization through one compiled kernel (`mtune.modules.nf4_dequantize`, used on CUDA) gives torchao's
eager values bit for bit, and the eager NF4 matmul (`FrozenNF4Matmul`) gives torchao's `linear_nf4` forward and
input gradient bit for bit. The kernel is exercised on the CPU here (Inductor's C++ backend) by letting it apply to
CPU weights; on CUDA it is the same function under Triton."""

import logging

import pytest
import torch

from mtune.modules import nf4_dequantize
from mtune.modules.nf4_linear import FrozenNF4Matmul, dequantize, nf4_part, quantize_nf4


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    monkeypatch.setattr(nf4_dequantize, "compiled_dequantization_applies", lambda weight: True)
    monkeypatch.setattr(nf4_dequantize, "_kernel", None)
    monkeypatch.setattr(nf4_dequantize, "COMPILED_ON_CUDA", True)


def test_the_compiled_kernel_gives_torchaos_values_bit_for_bit(kernel_on_cpu):
    """A whole weight and an eighth of an expert stack (the parts the grouped experts dequantize), bf16 and fp32.
    Mutation seen failing: the whole of torchao's get_original_weight compiled (on torch 2.11, 26,730 of the bf16
    weight's 131,072 values one bf16 step off: Inductor rounded the scales' division and sum once; torch 2.13 gets
    them right)."""
    torch.manual_seed(0)
    stack = quantize_nf4((torch.randn(16, 96, 256) * 0.02).to(torch.bfloat16))
    for weight in (quantize_nf4(torch.randn(128, 256) * 0.02), quantize_nf4(torch.randn(256, 512).bfloat16()),
                   nf4_part(stack, 8, 3), nf4_part(stack, 8, 5)):
        got = dequantize(weight)
        assert nf4_dequantize._kernel is not None  # the kernel ran, not the eager fallback
        want = weight.get_original_weight()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_the_kernel_compiles_for_more_weight_shapes_than_dynamos_default_limit(kernel_on_cpu, monkeypatch, caplog):
    """Twelve weight shapes (a hybrid or MoE model has more than dynamo's 8 per function): each dequantizes through
    the kernel, bit for bit torchao's, and the kernel stays on. The kernel is compiled with dynamo's eager backend
    here (the shapes' guards and recompiles are dynamo's; Inductor's C++ builds would take minutes). Mutation seen
    failing: the kernel called without raising the limit (the ninth shape raises, the warning is logged and
    COMPILED_ON_CUDA turns False)."""
    torch._dynamo.reset()
    monkeypatch.setattr(nf4_dequantize, "_kernel", torch.compile(nf4_dequantize.decode, backend="eager",
                                                                 dynamic=False, fullgraph=True))
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="mtune"):
        for rows in range(1, 13):
            weight = quantize_nf4(torch.randn(128 * rows, 128) * 0.02)
            assert torch.equal(dequantize(weight), weight.get_original_weight()), rows
    assert nf4_dequantize.COMPILED_ON_CUDA is True and not [r for r in caplog.records if r.name == "mtune"]
    torch._dynamo.reset()


def test_under_the_byte_tracker_the_kernel_compiles_and_the_tracker_counts_its_result(kernel_on_cpu, monkeypatch,
                                                                                        caplog):
    """plan_check's first steps run under the byte tracker, a dispatch mode dynamo does not compile under: the kernel
    runs with the mode set aside, compiles, gives torchao's values, and the tracker counts its result; it stays on
    after. Mutations seen failing: the kernel called under the tracker (torch 2.13 raises, every later weight takes
    torchao's ops: COMPILED_ON_CUDA turns False, a warning); the result returned without the view made under the
    tracker (the tracker then counts nothing)."""
    from mtune.training.planning.tracker import TensorTracker

    torch._dynamo.reset()
    calls = []
    compiled = torch.compile(nf4_dequantize.decode, backend="eager", dynamic=False, fullgraph=True)
    monkeypatch.setattr(nf4_dequantize, "_kernel", lambda *inputs: calls.append(1) or compiled(*inputs))
    torch.manual_seed(0)
    weight = quantize_nf4(torch.randn(256, 128) * 0.02)
    tracker = TensorTracker()
    with caplog.at_level(logging.WARNING, logger="mtune"):
        with tracker:
            tracked = dequantize(weight)
        after = dequantize(weight)
    assert nf4_dequantize.COMPILED_ON_CUDA is True and not [r for r in caplog.records if r.name == "mtune"]
    assert calls == [1, 1]  # the kernel ran under the tracker and after it
    assert torch.equal(tracked, weight.get_original_weight()) and torch.equal(after, tracked)
    assert tracker.take_interval().peak["device"] >= tracked.numel() * tracked.element_size()
    torch._dynamo.reset()


def test_a_kernel_that_cannot_be_built_says_why_once_and_the_eager_ops_run(kernel_on_cpu, monkeypatch, caplog):
    def broken(*inputs):
        raise RuntimeError("no working C++ compiler found\nsecond line")

    monkeypatch.setattr(nf4_dequantize, "_kernel", broken)
    weight = quantize_nf4(torch.randn(128, 128))
    with caplog.at_level(logging.WARNING, logger="mtune"):
        got = dequantize(weight)
    assert torch.equal(got, weight.get_original_weight())
    assert nf4_dequantize.COMPILED_ON_CUDA is False
    assert [r.getMessage() for r in caplog.records] == [
        "NF4 dequantization could not be compiled on cpu (no working C++ compiler found): torchao's eager ops run "
        "instead"]


def test_the_eager_nf4_matmul_is_torchaos_linear_nf4_bit_for_bit():
    """Forward and the input's gradient, bf16; the weight gets no gradient and stays NF4 (saved as it is, not its
    dequantized copy)."""
    from mtune.modules.nf4_linear import _nf4_api

    torch.manual_seed(0)
    weight = torch.nn.Parameter(quantize_nf4((torch.randn(256, 128) * 0.05).bfloat16()), requires_grad=False)
    x = torch.randn(4, 16, 128, dtype=torch.bfloat16)
    grad = torch.randn(4, 16, 256, dtype=torch.bfloat16)
    outs = []
    for linear in (FrozenNF4Matmul.apply, lambda x, w: _nf4_api().linear_nf4(input=x, weight=w)):
        xg = x.clone().requires_grad_()
        out = linear(xg, weight)
        out.backward(grad)
        outs.append((out, xg.grad))
    for ours, torchaos in zip(*outs):
        assert torch.equal(ours, torchaos)
    assert weight.grad is None


def test_running_out_of_memory_in_the_kernel_is_the_steps_error_not_a_build_failure(kernel_on_cpu, monkeypatch):
    """An out-of-memory error while the kernel runs reaches the run's out-of-memory handling (and recovery) as it is,
    and the kernel stays in use; it is not taken for a kernel that cannot be built. Mutation seen failing: the
    broad fallback catching it (the eager ops ran and the kernel was switched off)."""
    def out_of_memory(*inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(nf4_dequantize, "_kernel", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        dequantize(quantize_nf4(torch.randn(128, 128)))
    assert nf4_dequantize.COMPILED_ON_CUDA is True


def test_the_kernel_applies_to_real_cuda_weights_outside_compiled_code_only(monkeypatch):
    """The kernel's gate: a real CUDA weight, eager, while the kernel is on (a stand-in carries the CUDA device: this
    machine may have no GPU). Not a CPU weight (the CPU runs torchao's ops), not a fake CUDA weight (the planner's,
    which models the kernel itself), not inside compiled code (traced with the rest), not once the kernel was found
    unbuildable (else every weight would try and warn again). Mutations seen failing: the device test flipped to
    ``!=``; the is_compiling, is_fake and COMPILED_ON_CUDA terms each dropped."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    applies = nf4_dequantize.compiled_dequantization_applies
    monkeypatch.setattr(nf4_dequantize, "COMPILED_ON_CUDA", True)
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    assert applies(cuda)
    assert not applies(quantize_nf4(torch.randn(128, 128)))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = quantize_nf4(torch.empty(128, 128, dtype=torch.bfloat16, device="cuda"))
    assert fake.device.type == "cuda" and not applies(fake)
    with monkeypatch.context() as inside:
        inside.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not applies(cuda)
    monkeypatch.setattr(nf4_dequantize, "COMPILED_ON_CUDA", False)
    assert not applies(cuda)


@pytest.mark.parametrize("builds", [True, False])
def test_the_kernel_leaves_dynamos_recompile_limit_as_it_found_it(kernel_on_cpu, monkeypatch, builds):
    """The recompile limit is raised for the kernel's call only: the process's own limit (the user's compiled model's)
    is the same after a call, whether the kernel ran or could not be built. Mutation seen failing: the limit not
    restored in ``finally`` (left at KERNEL_SHAPES for every later compile in the process)."""
    def kernel(*inputs):
        assert torch._dynamo.config.recompile_limit == nf4_dequantize.KERNEL_SHAPES
        if not builds:
            raise RuntimeError("no working C++ compiler found")
        return nf4_dequantize.decode(*inputs)

    monkeypatch.setattr(nf4_dequantize, "_kernel", kernel)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 5)
    weight = quantize_nf4(torch.randn(128, 128))
    assert torch.equal(dequantize(weight), weight.get_original_weight())
    assert torch._dynamo.config.recompile_limit == 5
