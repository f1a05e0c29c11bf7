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


def test_a_candidate_the_host_kept_inputs_on_the_device_for_prunes_nothing(tmp_path, tiny_checkpoint, tiny_data,
                                                                          monkeypatch):
    """A candidate over the device only because the host's room kept blocks' inputs on it (`fewer_offloaded_blocks`
    applied) says nothing of those it out-saves: one that offloads less elsewhere (weights on the host) leaves the
    host room for more inputs. Llama 3.1 8B QLoRA ``--maximize`` at 40 GiB with a 23 GiB host met it: leaf-level
    weight offloading with 18 inputs offloaded was over the device, pruned the same without weight offloading (24
    offloaded, within it) and the search at the reached length found nothing. Here the host's rule is stubbed to
    say so of the cheapest tier's most-saving member (every second block checkpointed); the plain config, which it
    out-saves, must still be planned and answered. Mutation seen failing: recording that failure for pruning
    answers full checkpointing instead."""
    import dataclasses

    import mtune.training.planning.fit as fit_module

    def host_rule(cfg, plan, estimator, host_spare):
        if cfg.enable_activation_checkpointing and cfg.activation_checkpointing_every_n_layers == 2:
            return {"activation_offloading_blocks": 0}, dataclasses.replace(
                plan, device_peak_bytes=plan.device_peak_bytes + DEVICE)
        return None

    monkeypatch.setattr(fit_module, "fewer_offloaded_blocks", host_rule)
    _, _, _, _, found = _search(tmp_path, tiny_checkpoint, tiny_data, None, device_memory=2 * DEVICE)
    answer = best_of(found)
    assert answer is not None and answer.changes == {}
    every_second = [c for c in found if c.changes.get("activation_checkpointing_every_n_layers") == 2]
    assert every_second and every_second[0].fits is False and every_second[0].pruned is False
