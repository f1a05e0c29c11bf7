"""Op-level selective activation checkpointing (``activation_checkpointing_policy: selective_op``): the same
gradients as no checkpointing, and live activation bytes strictly between no checkpointing and whole-block
checkpointing, measured with torch's MemTracker (which sees the tensors kept inside checkpoint regions)."""

import copy
import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from mtune.config.errors import ConfigError
from mtune.training.memory.registry import MemoryConfig
from mtune.models import build_model
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing
from mtune.training.memory.techniques.activation_offloading.offload import OffloadActivations
from tests._helpers.training import apply_memory_techniques
from mtune.training.placement import Placement
from tests._helpers.training import assert_close, assert_identical, loss_and_grads

gen = torch.Generator().manual_seed(7)
TOKENS = torch.randint(0, 512, (2, 64), generator=gen)
LABELS = torch.randint(0, 512, (2, 64), generator=gen)
LORA = {"modules": ["q_proj", "v_proj", "down_proj"], "rank": 4, "alpha": 8, "dropout": 0.1}


def _model(n_layers=4):
    torch.manual_seed(0)
    return build_model("llama3_1", "tiny", device="cpu", n_layers=n_layers)


def _loss_and_grads(model, activation_context=None):
    return loss_and_grads(model, TOKENS, LABELS, activation_context, seed=1)  # the same dropout masks both sides


_assert_identical = assert_identical


def _activation_mib_after_forward(model):
    """Activation bytes alive once forward (loss included) is done, i.e. what backward will read: MemTracker counts
    every tensor created in forward, those kept by checkpointing's selective cache included."""
    tracker = MemTracker()
    tracker.track_external(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker's hooks warn about modules it no longer sees in backward
        with tracker:
            loss_sum, n = CrossEntropyLoss()(model(TOKENS), LABELS)
            live = tracker.get_tracker_snapshot("current")
            (loss_sum / n).backward()
    (device_stats,) = live.values()
    return device_stats[_MemRefType.ACT] / 2**20


def test_selective_op_gives_the_gradients_of_no_checkpointing():
    lora = _model(n_layers=2)
    apply_memory_techniques(lora, MemoryConfig(), lora=LORA)  # adapters with dropout: the RNG is replayed too
    with torch.no_grad():  # a trained adapter (B != 0): the update really changes each adapted matmul's output
        for name, p in lora.named_parameters():
            if "lora_b" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(3))
    selective = apply_activation_checkpointing(copy.deepcopy(lora), every_n_layers=2, policy="selective_op")
    assert [k for k, _ in selective.named_parameters()] == [k for k, _ in lora.named_parameters()]
    _assert_identical(_loss_and_grads(lora), _loss_and_grads(selective))
    full = _model(n_layers=2)  # a full fine-tune: every weight's gradient
    _assert_identical(_loss_and_grads(full),
                      _loss_and_grads(apply_activation_checkpointing(copy.deepcopy(full), policy="selective_op")))


def test_selective_op_keeps_activations_between_none_and_block():
    plain = _model(n_layers=2)
    none = _activation_mib_after_forward(plain)
    block = _activation_mib_after_forward(apply_activation_checkpointing(copy.deepcopy(plain), policy="block"))
    selective = _activation_mib_after_forward(apply_activation_checkpointing(copy.deepcopy(plain),
                                                                             policy="selective_op"))
    every_2nd = _activation_mib_after_forward(apply_activation_checkpointing(copy.deepcopy(plain), every_n_layers=2,
                                                                             policy="selective_op"))
    # Measured (2 layers, dim 256, batch 2 x 64, fp32): none 4.94 MiB, selective_op every block
    # 3.19, every 2nd block 4.07, block 0.94 (per block: 2.00 MiB kept without checkpointing, 1.13 by selective_op,
    # 0.125 = its input by block); the logits and loss (~0.7 MiB) are in all of them.
    assert block < selective < every_2nd < none, (none, every_2nd, selective, block)


def test_selective_op_with_activation_offloading_round_trips_through_the_host():
    plain = _model(n_layers=2)
    offloaded = copy.deepcopy(plain)
    apply_activation_checkpointing(plain, policy="selective_op")
    apply_activation_checkpointing(offloaded, policy="selective_op")
    placement = Placement("cpu", distinct=True)  # copies really happen, as between a GPU and its host
    ctx = OffloadActivations(use_streams=False, min_offload_bytes=0, params=offloaded.parameters(),
                             placement=placement)
    _assert_identical(_loss_and_grads(plain), _loss_and_grads(offloaded, ctx))
    assert ctx.offloaded_bytes > 0


def _record_kept_ops(monkeypatch) -> list[str]:
    """The ops selective_op keeps in forward (not recompute), appended to the returned list as the policy decides."""
    import mtune.training.memory.techniques.activation_checkpointing.checkpoint as checkpointing

    kept = []
    policy = checkpointing.selective_op_policy

    def recording_policy(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        if not ctx.is_recompute and decision == checkpointing.CheckpointPolicy.MUST_SAVE:
            kept.append(str(func))
        return decision

    monkeypatch.setattr(checkpointing, "selective_op_policy", recording_policy)
    return kept


def test_selective_op_keeps_every_matmul_and_the_attention_output_on_cpu(monkeypatch):
    """Guards the saved-op list: each of a block's 7 linears (aten.mm) and its CPU attention kernel are kept."""
    kept = _record_kept_ops(monkeypatch)
    model = apply_activation_checkpointing(_model(n_layers=2), policy="selective_op")
    model(TOKENS[:, :16]).sum().backward()
    # q, k, v, o, gate, up, down: bias-free linears lower to aten.mm; one attention call per block
    assert kept.count("aten.mm.default") == 2 * 7, kept
    assert kept.count("aten._scaled_dot_product_flash_attention_for_cpu.default") == 2, kept
    assert len(kept) == 2 * 8, kept


def test_configured_policy_reaches_the_blocks():
    """Guards on_model passing activation_checkpointing_policy (not a fixed "block") to the blocks."""
    from mtune.training.memory.techniques.activation_checkpointing.checkpoint import checkpoint_policy

    model = _model(n_layers=3)
    apply_memory_techniques(model, MemoryConfig(enable_activation_checkpointing=True,
                                                activation_checkpointing_every_n_layers=2,
                                                activation_checkpointing_policy="selective_op"))
    assert [checkpoint_policy(b) for b in model.layers] == ["selective_op", None, "selective_op"]


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="activation_checkpointing_policy must be one of block, selective_op"):
        apply_activation_checkpointing(_model(n_layers=1), policy="ops")


@pytest.mark.slow
def test_compile_per_block_with_selective_op_matches_eager():
    plain = _model(n_layers=1)  # compile on CPU is slow: one block
    compiled = copy.deepcopy(plain)
    memory = dict(enable_activation_checkpointing=True, activation_checkpointing_policy="selective_op")
    apply_memory_techniques(compiled, MemoryConfig(**memory, compile=True), lora=LORA)
    apply_memory_techniques(plain, MemoryConfig(**memory), lora=LORA)
    compiled.load_state_dict(plain.state_dict())
    plain.eval(), compiled.eval()  # no dropout: compiled and eager draw their masks differently
    assert_close(_loss_and_grads(plain), _loss_and_grads(compiled))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_selective_op_on_cuda_keeps_the_attention_kernel_output_and_is_exact(monkeypatch):
    # CUDA runs other attention kernels than the CPU (flash / efficient / cuDNN): the policy must know the one used.
    kept = _record_kept_ops(monkeypatch)
    plain = _model(n_layers=2).cuda().to(torch.bfloat16)
    selective = apply_activation_checkpointing(copy.deepcopy(plain), policy="selective_op")
    tokens, labels = TOKENS.cuda(), LABELS.cuda()

    def run(model):
        loss_sum, n = CrossEntropyLoss()(model(tokens), labels)
        (loss_sum / n).backward()
        return loss_sum.detach(), {k: p.grad for k, p in model.named_parameters()}

    _assert_identical(run(plain), run(selective))
    assert any("scaled_dot_product" in name for name in kept), sorted(set(kept))
