"""``--fit`` under a small host, on the tiny model (2 blocks, batch 32 x 64 tokens: each block's input is 2 MiB, and
the loss's saved inputs 6 MiB more, all offloaded with activation offloading): an answer that offloads every
block's input where the host holds only one of them offloads that one (``activation_offloading_blocks: 1``) and
fits the host to the byte; with a host too small for any of them, nothing fits and the answer names the host
memory the all-offloaded answer's own plan needs."""

from mtune._cli.catalog import find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.memory.technique import FitChoice
from mtune.training.planning.candidates import KNOBS, Knob
from mtune.training.planning.estimate import Estimator
from mtune.training.planning.fit import best_of, host_that_fits, search
from mtune.training.planning.host import host_line
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES
from tests._helpers.recipes import TRAIN_CONFIG, train_overrides

MIB = 1 << 20
BLOCK_INPUT = 32 * 64 * 256 * 4  # one block's input, fp32: 2 MiB
OUTSIDE = 6 * MIB  # what the loss saves, offloaded too (planned: 0 blocks offloaded puts 6 MiB on the host)
# the whole plan's device peak of 1 of 2 blocks offloaded is 48405504 bytes; the estimate between 0 and 2 blocks
# (conservative on the device) is 49454080, and 0 blocks need 50502656: the budget admits the estimate only
DEVICE = CUDA_CONTEXT_BYTES + 49454080 + 4096


def _search(tmp_path, checkpoint, data, host_memory, estimator=None, device_memory=DEVICE):
    module = load_recipe_module(find_recipe("lora_single_device"))
    cfg = load_and_check(module, TRAIN_CONFIG, train_overrides(tmp_path, checkpoint, data, **{
        "dataset.packed": True, "tokenizer.max_seq_len": 64, "batch_size": 32, "device": "cuda",
        "activation_offloading_use_streams": False}))
    knobs = [k for k in KNOBS if k.name == "activation_checkpointing"] + [Knob("micro_batch",
                                                                               lambda c: [FitChoice(0, {})])]
    estimator = estimator or Estimator(device_memory=device_memory, host_memory=host_memory)
    found = search(cfg, module.SCHEMA, device_memory=device_memory, host_memory=host_memory, knobs=knobs, margin=0,
                   estimator=estimator)
    return cfg, module, knobs, estimator, found


def test_the_answer_offloads_the_blocks_the_host_holds_and_fits_it(tmp_path, tiny_checkpoint, tiny_data):
    """Mutation checked: `MemoryPlan.fits` leaving out the host (spare None) answers every block offloaded, 10 MiB
    on an 8 MiB host."""
    host = OUTSIDE + BLOCK_INPUT  # 8 MiB: one block's input beside the loss's
    _, _, _, _, found = _search(tmp_path, tiny_checkpoint, tiny_data, host)
    answer = best_of(found)
    assert answer is not None and answer.changes["activation_offloading_blocks"] == 1
    assert answer.changes["enable_activation_offloading"] is True
    assert answer.plan.host_need_bytes == host  # 6 MiB + 1 block input, to the byte
    assert answer.plan.device_total_bytes <= DEVICE


def test_a_host_too_small_names_the_host_its_answer_needs(tmp_path, tiny_checkpoint, tiny_data):
    host = OUTSIDE - 1  # not even what the loss saves
    cfg, module, knobs, estimator, found = _search(tmp_path, tiny_checkpoint, tiny_data, host)
    assert best_of(found) is None
    larger = host_that_fits(cfg, module.SCHEMA, device_memory=DEVICE, host_memory=host, margin=0, world_size=1,
                            lossy="fallback", estimator=estimator, knobs=knobs)
    assert larger is not None and larger.plan.host_need_bytes == OUTSIDE + 2 * BLOCK_INPUT  # every block: 10 MiB
    line = host_line(larger, 1, "the answer")
    assert "--host-memory 1GiB or more (its plan's host share 10.0 MiB)" in line
    assert "enable_activation_offloading=true" in line


def _judged(tmp_path, checkpoint, data, monkeypatch, order):
    """The tiny config's candidates over weight offloading and activation checkpointing, put to a `Judge` in
    ``order`` (functions picking one each) after the one with leaf-level weight offloading and every block's input
    offloaded was judged over the device because the host's room kept its inputs there (the host's rule stubbed
    to say so: its real plan fits)."""
    import dataclasses

    import mtune.training.planning.judge as judge_module
    from mtune.training.planning.candidates import candidates_of
    from mtune.training.planning.judge import Judge

    def offloads_weights(cfg) -> bool:
        return (cfg.get("weight_offloading") or {}).get("type") == "leaf_level"

    def host_rule(cfg, plan, estimator, host_spare):
        if offloads_weights(cfg) and cfg.enable_activation_offloading:
            return {"activation_offloading_blocks": 0}, dataclasses.replace(
                plan, device_peak_bytes=plan.device_peak_bytes + 10 * DEVICE)
        return None

    monkeypatch.setattr(judge_module, "fewer_offloaded_blocks", host_rule)
    module = load_recipe_module(find_recipe("lora_single_device"))
    cfg = load_and_check(module, TRAIN_CONFIG, train_overrides(tmp_path, checkpoint, data, **{
        "dataset.packed": True, "tokenizer.max_seq_len": 64, "batch_size": 32, "device": "cuda",
        "activation_offloading_use_streams": False}))
    knobs = [k for k in KNOBS if k.name in ("weight_offloading", "activation_checkpointing")] + [
        Knob("micro_batch", lambda c: [FitChoice(0, {})])]
    candidates = candidates_of(cfg, module.SCHEMA, knobs)
    judge = Judge(cfg, Estimator(device_memory=2 * DEVICE, host_memory=None), knobs=knobs, device_memory=2 * DEVICE,
                  host_memory=None, margin=0, world_size=1)
    kept = next(c for c in candidates if offloads_weights(c.cfg) and c.cfg.enable_activation_offloading)
    judge.consider(kept)
    assert kept.fits is False and judge.failed_kept and not judge.failed
    picked = [next(c for c in candidates if pick(c.cfg)) for pick in order]
    for candidate in picked:
        judge.consider(candidate)
    return picked


def test_a_candidate_the_host_kept_inputs_on_the_device_for_prunes_only_those_offloading_as_much(
        tmp_path, tiny_checkpoint, tiny_data, monkeypatch):
    """A candidate over the device only because the host's room kept blocks' inputs on it (`fewer_offloaded_blocks`
    applied) says something only of those it out-saves that offload as much (`Knob.offloads`: the weights here):
    they have no more room for inputs on the host and save less elsewhere. One that offloads less leaves the host
    room for more inputs and may fit: Llama 3.1 8B QLoRA ``--maximize`` at 40 GiB with a 23 GiB host met it
    (leaf-level weight offloading with 18 inputs offloaded over the device; block-level with 20, and none with
    24, within it). Here: leaf-level weight offloading with every block checkpointed and none offloaded is pruned
    unplanned; no weight offloading with every input offloaded is planned and fits. Mutations seen failing: the
    kept failure pruning whatever the offloading knobs' levels (the second pruned); not pruning at all (the first
    planned)."""
    same_host, more_room = _judged(tmp_path, tiny_checkpoint, tiny_data, monkeypatch, [
        lambda c: (c.get("weight_offloading") or {}).get("type") == "leaf_level"
        and c.enable_activation_checkpointing and not c.enable_activation_offloading
        and c.activation_checkpointing_every_n_layers == 1,
        lambda c: not c.get("weight_offloading") and c.enable_activation_offloading])
    assert same_host.pruned and same_host.plan is None and same_host.fits is False
    assert not more_room.pruned and more_room.plan is not None and more_room.fits is True
