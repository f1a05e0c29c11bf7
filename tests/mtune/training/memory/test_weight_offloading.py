"""weight_offloading against the plain model: bit-identical losses and gradients, and, counted every time weights
are copied to the compute device, at most ``blocks_per_group`` blocks (twice that with ``use_streams``; leaf_level:
one leaf, or two) materialised during forward, backward and recomputation.

On this CPU-only machine ``Placement("cpu", distinct=True)`` makes every move a real copy; an offloaded weight's
device storage is empty (0 bytes) while it is away, so "materialised" is read off the storages themselves."""

import copy

import pytest
import torch

from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.techniques.weight_offloading import WeightOffloading
from mtune.models import build_model
from mtune.modules.lora import apply_lora
from mtune.modules.loss import ChunkedCrossEntropyLoss, CrossEntropyLoss
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import is_checkpointed
from tests._helpers.training import apply_memory_techniques
from mtune.training.placement import Placement
from mtune.training.memory.tensor_bytes import plain_parts
from mtune.training.memory.techniques.weight_offloading.offloader import _in_backward, weight_offloader
from tests._helpers.offloading import LABELS, LORA, N_LAYERS, TOKENS, offloaded_loss_and_grads, offloaded_pair
from tests._helpers.training import assert_identical

def _materialised(units) -> int:
    """How many of ``units`` (blocks, or leaf modules) hold any offloaded weight in device memory right now."""
    return sum(any(t.untyped_storage().nbytes() > 0 for p in unit.parameters() if not p.requires_grad
                   for t in plain_parts(p)) for unit in units)


def _instrument(model, offloader):
    """Count materialised units after every copy to the device, tagged with the phase it happened in, and check
    in every forward (recomputation included) that the module about to run has its weights."""
    units = list(model.layers) if offloader.config.type == "block_level" else [m for g in offloader.groups for m in g]
    log = []
    original = offloader._copy_in

    def copy_in(g, prefetch):
        original(g, prefetch)
        log.append(("backward" if _in_backward() else "forward", _materialised(units)))

    offloader._copy_in = copy_in
    recomputed = []
    for module in (m for group in offloader.groups for m in group):
        def check(module, args):
            assert all(t.untyped_storage().nbytes() > 0 for p in module.parameters(recurse=False)
                       for t in plain_parts(p))
            if _in_backward():
                recomputed.append(module)
        module.register_forward_pre_hook(check)  # after the offloader's own pre-hook
    return log, recomputed


# (type, blocks_per_group, use_streams, activation checkpointing): each bound (1, 2 x 2 blocks; 1 or 2 leaves) and
# each type with and without recomputation.
CASES = [("block_level", 1, False, True), ("block_level", 2, True, True), ("block_level", 1, True, False),
         ("leaf_level", 1, False, True), ("leaf_level", 1, True, False)]


@pytest.mark.parametrize("kind,blocks_per_group,use_streams,checkpointing", CASES)
def test_exact_and_at_most_one_group_on_the_device(kind, blocks_per_group, use_streams, checkpointing):
    memory = MemoryConfig(enable_activation_checkpointing=checkpointing,
                          weight_offloading=WeightOffloading(kind, blocks_per_group, use_streams))
    plain, twin, offloader, _ = offloaded_pair(memory)
    assert all(is_checkpointed(b) == checkpointing for b in twin.layers)
    log, recomputed = _instrument(twin, offloader)
    assert _materialised(twin.layers) == 0  # after offload(): every frozen block weight waits on the host
    assert_identical(offloaded_loss_and_grads(plain), offloaded_loss_and_grads(twin))
    bound = (blocks_per_group if kind == "block_level" else 1) * (2 if use_streams else 1)
    phases = {phase for phase, _ in log}
    assert phases == {"forward", "backward"} and max(count for _, count in log) == bound, log
    if checkpointing:  # recomputation ran each block's modules again, each with its weights
        assert len(recomputed) >= N_LAYERS
    # Trainable adapters never left; frozen weights did, and came back the number of times the design says.
    assert all(p.untyped_storage().nbytes() > 0 for p in twin.parameters() if p.requires_grad)
    frozen = sum(slot.nbytes for slots in offloader._slots for slot in slots)
    # Forward brings every group, backward those whose weights its gradients need, again (not the last one, still
    # there from forward, nor those upstream of every trained weight, such as the embedding).
    assert offloader.copies_to_compute > frozen


@pytest.mark.parametrize("kind,use_streams", [("leaf_level", True), ("leaf_level", False), ("block_level", True)])
def test_exact_under_selective_op_checkpointing(kind, use_streams):
    # selective_op counts every op a checkpointed block runs and requires its recomputation to run the same ones;
    # weights are copied in at other points in recomputation than in forward (leaf_level: every leaf, not the last
    # one still there), so those copies must stay out of that count (before: "aten.copy_.default invocation index 9
    # encountered during backward but not found in storage").
    memory = MemoryConfig(enable_activation_checkpointing=True, activation_checkpointing_policy="selective_op",
                          weight_offloading=WeightOffloading(kind, 1, use_streams))
    plain, twin, offloader, _ = offloaded_pair(memory)
    log, recomputed = _instrument(twin, offloader)
    assert_identical(offloaded_loss_and_grads(plain), offloaded_loss_and_grads(twin))
    assert {phase for phase, _ in log} == {"forward", "backward"} and len(recomputed) >= N_LAYERS
    assert max(count for _, count in log) == (2 if use_streams else 1), log


def test_stacks_with_qlora_checkpointing_and_activation_offloading():
    memory = MemoryConfig(enable_activation_checkpointing=True, enable_activation_offloading=True,
                          weight_offloading=WeightOffloading("leaf_level", 1, True))
    plain, twin, offloader, ctx = offloaded_pair(memory, lora={**LORA, "quantize_base": True}, dtype=torch.bfloat16,
                                        n_layers=2)
    ctx.min_offload_bytes = 0
    from mtune.modules.nf4_linear import is_nf4

    assert any(is_nf4(p) for p in twin.parameters())
    log, _ = _instrument(twin, offloader)
    # NF4 weights move as their packed parts; the plain model runs the same NF4 arithmetic in place.
    assert_identical(offloaded_loss_and_grads(plain), offloaded_loss_and_grads(twin, ctx))
    assert ctx.offloaded_bytes > 0 and max(count for _, count in log) == 2


def test_device_bytes_of_frozen_weights():
    """The measured effect on the 4-layer tiny model (fp32, LoRA on q/v/down): the frozen weights' device bytes at
    rest and at their peak in a training step, against the plain model's."""
    memory = MemoryConfig(weight_offloading=WeightOffloading("block_level", 1, False))
    plain, twin, offloader, _ = offloaded_pair(memory)

    def device_bytes(model):
        return sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.requires_grad)

    frozen = device_bytes(plain)
    peak = [0]
    for block in twin.layers:
        block.register_forward_hook(lambda *_: peak.__setitem__(0, max(peak[0], device_bytes(twin))))
    offloaded_loss_and_grads(twin)
    host = sum(slot.nbytes for slots in offloader._slots for slot in slots)
    block = sum(p.numel() * p.element_size() for p in twin.layers[0].parameters() if not p.requires_grad)
    # embed_tokens, the final norm and lm_head stay on the device with block_level; every block waits on the host.
    resident = frozen - N_LAYERS * block
    assert host == N_LAYERS * block and peak[0] == resident + block
    assert device_bytes(twin) == resident + block  # block 0: the last one backward used, kept for the next forward


def test_generation_with_offloaded_weights_matches():
    from mtune.modules.generation import generate_stream

    memory = MemoryConfig(weight_offloading=WeightOffloading("leaf_level", 1, True))
    torch.manual_seed(0)
    plain = build_model("llama3_1", "tiny", device="cpu", n_layers=2).requires_grad_(False)
    twin = copy.deepcopy(plain)
    apply_memory_techniques(twin, memory, placement=Placement("cpu", distinct=True))
    offloader = weight_offloader(twin)
    offloader.offload()
    prompt = TOKENS[0, :8].tolist()
    expected = [int(t[0]) for t in generate_stream(plain, prompt, 12)]
    assert [int(t[0]) for t in generate_stream(twin, prompt, 12)] == expected
    assert len(offloader.groups) == 2 * 9 + 3  # per block 2 norms + 7 linears; embedding, final norm, lm_head
    assert len(offloader.resident_groups()) <= 2


def test_a_tied_output_projection_shares_the_embeddings_group():
    torch.manual_seed(0)
    plain = build_model("llama3_2", "tiny", device="cpu", n_layers=1).requires_grad_(False)
    assert plain.lm_head.weight is plain.embed_tokens.weight
    twin = copy.deepcopy(plain)
    apply_memory_techniques(twin, MemoryConfig(weight_offloading=WeightOffloading("leaf_level", 1, False)),
                            placement=Placement("cpu", distinct=True))
    offloader = weight_offloader(twin)
    offloader.offload()
    assert [twin.embed_tokens, twin.lm_head] in offloader.groups
    assert torch.equal(twin(TOKENS), plain(TOKENS))


@pytest.mark.parametrize("family", ["llama3_2", "llama3_1"])  # the head tied to the embedding, and its own
def test_the_chunked_loss_projects_an_offloaded_head_once_in_forward(family):
    # The offloader's hooks only fetch the head's weight, so the chunked loss keeps its fused path: the head comes
    # in once, for forward; backward neither recomputes the logits nor fetches the frozen head again.
    torch.manual_seed(0)
    plain = build_model(family, "tiny", device="cpu", n_layers=2)
    apply_lora(plain, ["q_proj", "v_proj"], rank=4, alpha=8)
    twin = copy.deepcopy(plain)
    apply_memory_techniques(twin, MemoryConfig(weight_offloading=WeightOffloading("leaf_level", 1, True)),
                            placement=Placement("cpu", distinct=True))
    offloader = weight_offloader(twin)
    offloader.offload()
    loss_fn = ChunkedCrossEntropyLoss(num_chunks=4)
    assert not loss_fn.recomputes_projection(twin.lm_head)
    head = next(g for g, modules in enumerate(offloader.groups) if twin.lm_head in modules)
    fetched = []
    original = offloader._copy_in
    offloader._copy_in = lambda g, prefetch: (fetched.append((g, _in_backward())), original(g, prefetch))

    def step(model):
        total, n = loss_fn(model(TOKENS, return_hidden=True), LABELS, model.lm_head)
        (total / n).backward()
        return total.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    assert_identical(step(plain), step(twin))
    # forward: the embedding's visit, and the head's (the tied one is the embedding's group, sent away between)
    assert [g for g, backward in fetched if g == head and not backward] == [head] * (2 if family == "llama3_2" else 1)
    assert not [g for g, backward in fetched if g == head and backward], fetched


@pytest.mark.parametrize("config, storage", [("llama3_2/1B_lora_single_device", ()),
                                             ("llama3_2/1B_lora_single_device", ("weight_storage_dtype=float8_e4m3fn",)),
                                             ("llama3_1/8B_qlora_single_device", ())])
def test_the_floors_hold_the_frozen_weights_where_each_level_keeps_them(config, storage):
    # --fit rejects a candidate whose floor passes a budget unplanned, so a floor must never exceed its plan:
    # block_level keeps the embedding and output projection on the device, only the blocks' weights wait on the host;
    # fp8 storage's weights count a byte each, as stored once loaded
    from mtune.training.planning.cost import device_floor, model_facts
    from mtune.training.planning.plan import plan_memory
    from tests._helpers.shipped import shipped_on_tiny

    for level in ("block_level", "leaf_level"):
        cfg = shipped_on_tiny(config, *storage, f"weight_offloading={{type: {level}}}")[2]
        device, host = device_floor(cfg)
        facts, plan = model_facts(cfg), plan_memory(cfg)
        waiting = facts.frozen_in_blocks if level == "block_level" else facts.frozen_bytes
        assert host == {"frozen weights": waiting}
        assert device.get("frozen weights", 0) == facts.frozen_bytes - waiting
        assert 0 < waiting <= plan.host_peak_bytes and sum(device.values()) <= plan.device_peak_bytes
        if level == "block_level" and "qlora" not in config:  # exact but for NF4's rate of bytes a weight
            assert waiting == plan.host_peak_bytes  # the host holds the blocks' frozen weights as stored
    assert facts.frozen_in_blocks < facts.frozen_bytes  # the tiny models' embeddings are frozen bytes too


def test_a_cpu_only_placement_installs_nothing(caplog):
    model = build_model("llama3_1", "tiny", device="cpu", n_layers=1)
    with caplog.at_level("INFO", logger="mtune"):
        apply_memory_techniques(model, MemoryConfig(weight_offloading=WeightOffloading()), lora=LORA,
                                placement=Placement("cpu"))
    assert weight_offloader(model) is None and "nothing to offload" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,use_streams", [("block_level", False), ("block_level", True), ("leaf_level", True)])
def test_on_cuda_weights_wait_in_pinned_memory_and_results_match(kind, use_streams):
    torch.manual_seed(0)
    base = build_model("llama3_1", "tiny", device="cuda", n_layers=N_LAYERS)
    plain, twin = copy.deepcopy(base), copy.deepcopy(base)
    memory = MemoryConfig(enable_activation_checkpointing=True, weight_offloading=WeightOffloading(kind, 1, use_streams))
    apply_memory_techniques(plain, MemoryConfig(enable_activation_checkpointing=True), lora=LORA)
    apply_memory_techniques(twin, memory, lora=LORA, placement=Placement("cuda"))
    twin.load_state_dict(plain.state_dict())
    offloader = weight_offloader(twin)
    offloader.offload()
    assert (offloader.stream is not None) == use_streams
    assert all(slot.host.is_pinned() for slots in offloader._slots for slot in slots)
    before = torch.cuda.memory_allocated()
    tokens, labels = TOKENS.cuda(), LABELS.cuda()
    results = []
    for model in (plain, twin):
        loss_sum, n = CrossEntropyLoss()(model(tokens), labels)
        (loss_sum / n).backward()
        results.append((loss_sum.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    torch.cuda.synchronize()
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k])
    assert torch.cuda.memory_allocated() < before + sum(p.numel() * 4 for p in plain.layers.parameters()) / 2
