"""The chunked gated delta rule against the rule itself, one token at a time (an independent loop written here)."""

import pytest
import torch

from mtune.modules.gated_deltanet import causal_conv, chunked_gated_delta_rule, l2_normalize
from mtune.modules.packed_attention import Segments


def token_by_token(q, k, v, g, beta):
    """The recurrence as defined: per token, decay the state, write the correction of what it mispredicts, read."""
    b, h, s, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(s):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, :, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(out, dim=2)


def inputs(s, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 16, 8
    q = l2_normalize(torch.randn(b, h, s, dk, generator=gen, dtype=dtype)) * dk**-0.5
    k = l2_normalize(torch.randn(b, h, s, dk, generator=gen, dtype=dtype))
    v = torch.randn(b, h, s, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, h, s, generator=gen, dtype=dtype) * 0.5  # decays in (0.6, 1]
    beta = torch.rand(b, h, s, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("s,chunk", [(150, 64), (150, 16), (7, 64), (64, 64)])
def test_chunked_rule_equals_the_recurrence(s, chunk):
    """Several chunks, a partial last chunk, a sequence shorter than one chunk, exactly one chunk. (Seen failing, 0.14
    off, with the entering state's read dropped, `q_decayed @ state`; 0.2 off with the in-chunk decay left out of
    the write system.)"""
    q, k, v, g, beta = inputs(s)
    expected = token_by_token(q, k, v, g, beta)
    got = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    # the rule computes in fp32; the recurrence here in fp64
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)
    assert expected.abs().max() > 0.1  # outputs are not trivially small


def test_gradients_equal_the_recurrences():
    q, k, v, g, beta = (t.float().requires_grad_() for t in inputs(40, seed=1))
    torch.manual_seed(0)
    weight = torch.randn(2, 3, 40, 8)
    (chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=16) * weight).sum().backward()
    got = [t.grad.clone() for t in (q, k, v, g, beta)]
    for t in (q, k, v, g, beta):
        t.grad = None
    (token_by_token(q, k, v, g, beta) * weight).sum().backward()
    for ours, ref in zip(got, (q.grad, k.grad, v.grad, g.grad, beta.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_documents_restart_the_state_anywhere_in_a_chunk():
    """Documents of 5, 70, 1, 40 and 34 tokens packed in one row (boundaries inside chunks, a document spanning
    chunks, one a token long) give each document's outputs alone. (Seen failing with the entering state read by every
    token, 0.019 off, and with the leaving state keeping earlier documents' writes, 0.014 off.)"""
    lengths = [5, 70, 1, 40, 34]
    q, k, v, g, beta = inputs(sum(lengths), seed=3)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    got = chunked_gated_delta_rule(q, k, v, g, beta, documents, chunk_size=16)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = token_by_token(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part])
        torch.testing.assert_close(got[:, :, part].double(), alone, rtol=0, atol=2e-5)
        start += n


def test_convolution_sees_only_its_document():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 6, 12), torch.randn(6, 1, 4)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 2 + [1] * 10])
    got = causal_conv(x, weight, documents)
    for row in range(2):
        for doc in documents[row].unique():
            cols = (documents[row] == doc).nonzero().flatten()
            alone = causal_conv(x[row:row + 1, :, cols], weight)
            torch.testing.assert_close(got[row:row + 1, :, cols], alone)
    torch.testing.assert_close(causal_conv(x, weight, torch.zeros(2, 12, dtype=torch.long)), causal_conv(x, weight))


def fla_contract(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """flash-linear-attention's ``chunk_gated_delta_rule`` as its docstring states it (its kernels need Triton and
    CUDA): ``[B, T, H, K]`` queries and keys, ``[B, T, HV, V]`` values with ``HV`` a multiple of ``H`` (value heads
    grouped over consecutive query/key heads), ``[B, T, HV]`` log decays and write strengths, ``scale`` 1/sqrt(K)
    by default, and with ``cu_seqlens`` one flattened row (B = 1) whose sequences each start from a zero state.
    Written from that contract with :func:`token_by_token`, not from mtune's code."""
    assert q.shape == k.shape and v.shape[:2] == q.shape[:2] and v.shape[2] % q.shape[2] == 0
    assert cu_seqlens is None or q.shape[0] == 1
    group = v.shape[2] // q.shape[2]
    q, k = (t.float().repeat_interleave(group, dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = (t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    heads_first = [t.float().transpose(1, 2) for t in (q, k, v, g, beta)]
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    pieces = [token_by_token(*(t[:, :, start:end] for t in heads_first)) for start, end in zip(bounds, bounds[1:])]
    return torch.cat(pieces, dim=2).transpose(1, 2).to(v.dtype), None


def test_the_fla_kernel_path_gives_the_pytorch_forms_outputs(monkeypatch):
    """GatedDeltaNet through flash-linear-attention's kernel (here its stated contract, fla_contract) equals the
    PyTorch form on packed rows: raw queries and keys with the kernel's L2 norm and scale, grouped value heads,
    each packed document from a zero state. Mutations seen failing: the kernel not asked to normalise, packed rows
    passed without cu_seqlens, queries repeated over the value heads before the call."""
    from mtune.modules import gated_deltanet, gated_deltanet_fla
    from mtune.modules.gated_deltanet import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(dim=32, n_k_heads=2, n_v_heads=4, k_head_dim=8, v_head_dim=8).double()
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    segments = Segments(torch.tensor([0, 13, 40, 57, 80], dtype=torch.int32), 40)  # rows: 13 + 27, 17 + 23 tokens
    packed, rows = layer(x, segments=segments), layer(x)
    assert gated_deltanet_fla.fla_kernel(x) is None  # a CPU tensor: the PyTorch form
    monkeypatch.setattr(gated_deltanet, "fla_kernel", lambda x: fla_contract)
    # both in fp32 (as each casts), summed in other orders: fp32 round-off of outputs of magnitude ~1
    torch.testing.assert_close(layer(x, segments=segments), packed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer(x), rows, rtol=1e-5, atol=1e-6)


def test_the_log_says_which_recurrence_runs(monkeypatch):
    """CPU: the PyTorch form; CUDA without flash-linear-attention: that, and how to get the kernels; with it: the
    kernel. Mutation: naming the kernel whenever the device is CUDA fails the middle case."""
    from mtune.modules import gated_deltanet_fla

    assert gated_deltanet_fla.recurrence_runs("cpu") == "the PyTorch chunked form"
    monkeypatch.setattr(gated_deltanet_fla, "_fla_rule", False)  # flash-linear-attention not importable
    assert "pip install flash-linear-attention" in gated_deltanet_fla.recurrence_runs("cuda")
    monkeypatch.setattr(gated_deltanet_fla, "_fla_rule", fla_contract)
    assert gated_deltanet_fla.recurrence_runs("cuda") == "flash-linear-attention's chunk_gated_delta_rule"


def run_interpreted(script: str):
    """``script`` (beside this file) in a process of its own with flash-linear-attention and Triton on its path from
    ``MTUNE_FLA_ORACLE_PATH`` (skipped where unset) and Triton's interpreter on: its last line of output, as JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    oracle = os.environ.get("MTUNE_FLA_ORACLE_PATH")
    if not oracle:
        pytest.skip("MTUNE_FLA_ORACLE_PATH unset: scripts/test.sh installs fla-core and triton there")
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [oracle, str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_flash_linear_attentions_own_kernel_gives_the_pytorch_forms_outputs_and_gradients():
    """The real kernel (flash-linear-attention's chunk_gated_delta_rule, which scripts/test.sh installs apart from the
    environment), run by Triton's interpreter on the CPU in its own process (fla_interpreted.py), through
    GatedDeltaNet's call into it, against the PyTorch form: outputs, the input's gradient and every parameter's, in
    fp32, with grouped value heads, on rows and on packed rows. Mutations seen failing: the kernel not asked to
    L2-normalise, packed rows passed without cu_seqlens, the PyTorch form grouping value heads over query/key heads
    round-robin (repeat) instead of consecutively."""
    errors = run_interpreted("fla_interpreted.py")
    assert set(errors) == {"rows", "packed"} and len(errors["packed"]) == 11  # out, x's and 9 parameters' gradients
    # fp32 throughout, summed in other orders (the decay parameters' gradients sum every token): ~2e-5 measured
    worst = {case: max(by_tensor.items(), key=lambda item: item[1]) for case, by_tensor in errors.items()}
    assert all(error < 1e-4 for _, error in worst.values()), worst


class RefusesBackward(torch.autograd.Function):
    """Forward as the contract states; backward raises as flash-linear-attention 0.6 does on a Hopper GPU with
    Triton 3.6 (the message of the H100 lease's log, benchmarks/results/gpu_suite_logs/)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        with torch.no_grad():
            return fla_contract(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
                           "chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1\nsecond line")


@pytest.mark.parametrize("refuses", [True, False])
def test_a_kernel_that_refuses_backward_is_probed_and_not_used(monkeypatch, refuses):
    """flash-linear-attention installed but refusing backward on this GPU: the first call probes a gated forward
    and backward, the PyTorch form runs and the log says why, in the kernel's words (its first line), instead of the
    first step ending in a traceback. A kernel that trains passes the probe and runs. (The probe runs on the CPU
    here, on the run's CUDA device in a run.) Mutation seen failing: a probe of the forward alone."""
    import sys
    import types

    from mtune.modules import gated_deltanet_fla

    def refusing(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        return RefusesBackward.apply(q, k, v, g, beta), None

    kernel = refusing if refuses else fla_contract
    fla_module = types.SimpleNamespace(chunk_gated_delta_rule=kernel)
    monkeypatch.setitem(sys.modules, gated_deltanet_fla.FLA_MODULE, fla_module)
    monkeypatch.setattr(gated_deltanet_fla, "_fla_rule", None)
    probe = gated_deltanet_fla.fla_probe
    monkeypatch.setattr(gated_deltanet_fla, "fla_probe", lambda kernel, device: probe(kernel, "cpu"))
    said = gated_deltanet_fla.recurrence_runs("cuda")
    if refuses:
        assert said == ("the PyTorch chunked form (flash-linear-attention is installed but its kernel failed a gated "
                        "forward and backward: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results "
                        "for gated chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1)")
        assert gated_deltanet_fla._fla_import("cuda") is None
    else:
        assert said == "flash-linear-attention's chunk_gated_delta_rule"
        assert gated_deltanet_fla._fla_import("cuda") is fla_contract


def test_the_scan_runs_every_chunk_under_torch_compile():
    """On fake tensors the scan runs two chunks (what `mtune plan` needs); under torch.compile, whose tracing uses
    fake tensors too, every chunk must run: 5 chunks of 16, outputs and gradients as eager's. (aot_eager: dynamo and
    AOTAutograd's tracing, no code generation.) Mutation seen failing: the two-chunk rule keyed on torch's
    ``is_fake``, which is true inside compile's tracing too."""
    q, k, v, g, beta = (t.float() for t in inputs(80, seed=4))
    eager_in = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    compiled_in = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    torch._dynamo.reset()
    eager = chunked_gated_delta_rule(*eager_in, chunk_size=16)
    compiled = torch.compile(chunked_gated_delta_rule, backend="aot_eager", fullgraph=True)(*compiled_in, chunk_size=16)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    weight = torch.randn(eager.shape, generator=torch.Generator().manual_seed(0))
    (eager * weight).sum().backward()
    (compiled * weight).sum().backward()
    for ours, ref in zip(compiled_in, eager_in):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-5)


def test_the_scan_passes_gradients_into_the_entering_state_and_out_of_the_leaving_one():
    """Oracle: the scan's three lines (gated_delta_scan's docstring) through autograd, chunk by chunk. The
    loss reads the outputs and the leaving state: every input's gradient, the entering state's included."""
    from mtune.modules.gated_delta_scan import gated_delta_scan

    gen = torch.Generator().manual_seed(0)
    bh, n, c, dk, dv = 3, 4, 5, 6, 7
    shapes = [(bh, n, c, dv), (bh, n, c, dk), (bh, n, c, dk), (bh, n, c, c), (bh, n, dk, c)]
    tensors = [torch.randn(*shape, generator=gen) * 0.5 for shape in shapes]  # u, w, q, scores, k_end
    tensors += [torch.rand(bh, n, 1, 1, generator=gen) * 0.5 + 0.5, torch.randn(bh, dk, dv, generator=gen)]
    out_weight, state_weight = torch.randn(bh, n, c, dv, generator=gen), torch.randn(bh, dk, dv, generator=gen)

    def grads(scan):  # fp64 both: the scan's arithmetic is dtype-generic, so round-off hides nothing
        leaves = [t.double().requires_grad_() for t in tensors]
        out, leaving = scan(*leaves)
        ((out * out_weight.double()).sum() + (leaving * state_weight.double()).sum()).backward()
        return out, leaving, [t.grad for t in leaves]

    def by_definition(u, w, q, scores, k_end, decay, state):
        outs = []
        for i in range(n):
            delta = u[:, i] - w[:, i] @ state
            outs.append(scores[:, i] @ delta + q[:, i] @ state)
            state = decay[:, i] * state + k_end[:, i] @ delta
        return torch.stack(outs, 1), state

    out, leaving, got = grads(gated_delta_scan)
    want_out, want_leaving, want = grads(by_definition)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(leaving, want_leaving, rtol=1e-10, atol=1e-10)
    for name, g, w in zip(("u", "w", "q", "scores", "k_end", "decay", "initial"), got, want):
        assert g is not None, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


def test_the_planners_stand_in_allocates_what_flash_linear_attentions_kernel_allocates():
    """fla-core 0.6's chunk_gated_delta_rule run by Triton's interpreter on the CPU (fla_allocations.py, in its own
    process) under mtune's byte tracker, against the planner's stand-in (gated_deltanet_fla_plan.py) on the
    planner's fake tensors, through GatedDeltaNet's call into the kernel, forward and backward: the same live-byte
    changes in the same order and the same peak, exactly (integer index storages aside: the module docstrings). On
    rows and packed rows, grouped value heads, lengths not a multiple of 64, one chunk, and keys tiled twice.
    Mutations seen failing: the stand-in's transient ``v_new`` of backward dropped; ``A`` made in fp32."""
    cases = run_interpreted("fla_allocations.py")
    assert set(cases) == {"rows_grouped", "packed_grouped", "rows_one_chunk_k64"}
    for case, seen in cases.items():
        assert seen["plan"] == seen["fla"], case
        assert seen["plan_peak"] == seen["fla_peak"], case


def test_a_plan_counts_the_recurrence_the_run_will_use(monkeypatch):
    """A fake tensor's recurrence is the stand-in only inside planning_recurrence for a target that runs the kernel
    (here forced: no GPU), else None (the PyTorch form); a real CPU tensor never, nor a CPU target; a bad setting is
    one line.
    Mutation seen failing: planning_recurrence ignoring the setting."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mtune.modules import gated_deltanet, gated_deltanet_fla

    with FakeTensorMode():
        x = torch.empty(1, 4)
    with gated_deltanet.planning_recurrence("cuda"):
        assert gated_deltanet.recurrence_kernel(x) is None  # auto without a GPU here: the PyTorch form
    monkeypatch.setenv(gated_deltanet_fla.PLAN_ENV, "fla")
    with gated_deltanet.planning_recurrence("cuda"):
        assert gated_deltanet.recurrence_kernel(x) is not None
        assert gated_deltanet.recurrence_kernel(torch.empty(1, 4)) is None
    with gated_deltanet.planning_recurrence("cpu"):  # the kernel runs on CUDA only, whatever the setting
        assert gated_deltanet.recurrence_kernel(x) is None
    assert gated_deltanet.recurrence_kernel(x) is None
    monkeypatch.setenv(gated_deltanet_fla.PLAN_ENV, "triton")
    with pytest.raises(gated_deltanet_fla.PlanSettingError) as err:  # an MtuneError: the CLI prints one line
        gated_deltanet_fla.planned_recurrence("cuda")
    assert str(err.value) == "environment variable MTUNE_PLAN_GATED_DELTA_RULE='triton': use fla, pytorch or auto"


def test_the_kernels_probe_runs_on_real_tensors_when_a_plan_asks_first(monkeypatch):
    """A plan on the GPU machine asks whether the run will use the kernel (planned_recurrence) where its fake tensors
    are active: the probe must still run the kernel on real tensors, or a Triton kernel, which cannot run on fake
    ones, would fail it and the cached refusal would send the run itself to the PyTorch form. Here a kernel that,
    like Triton's, refuses fake inputs. Mutation seen failing: the probe run under the caller's modes."""
    import sys
    import types

    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from mtune.modules import gated_deltanet_fla

    def triton_like(q, k, v, g, beta, **kwargs):
        if is_fake(q):
            raise RuntimeError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        return fla_contract(q, k, v, g, beta, **kwargs)

    fla_module = types.SimpleNamespace(chunk_gated_delta_rule=triton_like)
    monkeypatch.setitem(sys.modules, gated_deltanet_fla.FLA_MODULE, fla_module)
    monkeypatch.setattr(gated_deltanet_fla, "_fla_rule", None)
    with FakeTensorMode():
        assert gated_deltanet_fla._fla_import("cpu") is triton_like
    assert gated_deltanet_fla._fla_refusal == ""  # no refusal kept for the run


@pytest.mark.parametrize("runs", ["flash-linear-attention's chunk_gated_delta_rule", "the PyTorch chunked form"])
def test_a_run_on_flas_kernels_says_its_first_steps_compile_them(monkeypatch, caplog, runs):
    """On an H100 the first step on fla's kernels took minutes on a fresh machine (Triton compiling and autotuning
    them; docs/benchmarks.md, the sixth lease): a run that uses them says so before that step, one on the PyTorch
    form does not."""
    from mtune.modules import gated_deltanet_fla
    from mtune.training.memory.techniques.attention_kernel import ATTENTION_KERNEL, AttentionKernelSettings
    from tests._helpers.models import mtune_twin, tiny_hf_model

    model = mtune_twin(tiny_hf_model("qwen3_5"), "qwen3_5")
    monkeypatch.setattr(gated_deltanet_fla, "recurrence_runs", lambda device: runs)
    with caplog.at_level("INFO"):
        ATTENTION_KERNEL.on_model(model, AttentionKernelSettings(), None, None)
    assert f"the recurrence runs {runs} on cpu" in caplog.text
    assert ("compile and autotune flash-linear-attention's Triton kernels" in caplog.text) == runs.startswith("flash")
