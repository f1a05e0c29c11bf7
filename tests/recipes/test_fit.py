"""``mtune plan --fit`` on tiny models: it runs on every shipped flag set (single-device and distributed) and every
YAML it writes validates; a lossy choice is made only when the lossless candidates measured over budget, and the
chosen config really runs under the budget; optimizer offload and paged optimizers put their states where they
live; each shortcut of the fast search (per-layer extrapolation, micro-batch derivation) against a whole plan; a
budget below the floor is refused without a plan."""

import json

import pytest

from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
from mtune._cli.run import load_and_check
from mtune.training.planning.estimate import Estimator
from mtune.training.planning.candidates import KNOBS
from mtune.training.planning.fit import best_of, numerics_line, search, write_config
from mtune.training.planning.plan import plan_memory
from tests._helpers.recipes import TRAIN_CONFIG, run_recipe_in_process, train_overrides
from tests._helpers.shipped import FLAG_SETS, shipped_on_tiny

PACKED = {"dataset.packed": True, "tokenizer.max_seq_len": 64, "max_steps_per_epoch": 2, "memory_breakdown": True}


@pytest.mark.parametrize("config", FLAG_SETS)
def test_fit_runs_on_every_shipped_flag_set_and_writes_valid_yaml(config, tmp_path):
    module, overrides, cfg = shipped_on_tiny(config)
    world_size = 2 if "distributed" in str(cfg.recipe) else 1
    candidates = search(cfg, module.SCHEMA, device_memory=1 << 30, world_size=world_size, max_plans=1,
                        margin=0, lossy="compete")
    assert candidates and any(c.plan is not None for c in candidates)
    # samples per step kept (read off each candidate's overrides: building all of its ~400 configs costs seconds)
    accumulation = [c.overrides.get("gradient_accumulation_steps", cfg.gradient_accumulation_steps)
                    for c in candidates]
    assert [c.micro_batch * a for c, a in zip(candidates, accumulation)] == \
        [cfg.batch_size * cfg.gradient_accumulation_steps] * len(candidates)
    # one plan is enough to run the search; the configs written cover a lossless and a lossy choice of each flag set
    lossy = [c for c in candidates if c.lossy][:1]
    for i, candidate in enumerate([c for c in candidates if c.plan is not None] + candidates[:3] + lossy):
        path = write_config(find_config(config), overrides, candidate.changes, tmp_path / f"fit{i}.yaml")
        load_and_check(module, path, [])  # raises on any problem the validator finds


def _tiny(tmp_path, checkpoint, data, changes):
    return train_overrides(tmp_path, checkpoint, data, **{**PACKED, **changes})


def test_lossy_only_when_lossless_measured_over_budget_and_the_answer_runs_under_it(tmp_path, tiny_checkpoint,
                                                                                     tiny_data):
    pytest.importorskip("bitsandbytes")
    recipe = "full_single_device"
    module = load_recipe_module(find_recipe(recipe))
    overrides = _tiny(tmp_path, tiny_checkpoint, tiny_data, {}) + ["~lora"]
    cfg = load_and_check(module, TRAIN_CONFIG, overrides)
    knobs = [k for k in KNOBS if k.name in ("optimizer", "micro_batch")]
    smallest_lossless = plan_memory(load_and_check(module, TRAIN_CONFIG, overrides + [
        "batch_size=1", f"gradient_accumulation_steps={cfg.batch_size * cfg.gradient_accumulation_steps}"]))
    eight_bit = plan_memory(load_and_check(module, TRAIN_CONFIG, overrides + [
        "optimizer._component_=bitsandbytes.optim.AdamW8bit"]))
    assert eight_bit.device_peak_bytes < smallest_lossless.device_peak_bytes
    budget = (eight_bit.device_peak_bytes + smallest_lossless.device_peak_bytes) // 2
    candidates = search(cfg, module.SCHEMA, device_memory=budget, knobs=knobs, margin=0)
    best = best_of(candidates)
    assert best is not None and best.lossy == ("8-bit optimizer states",)
    lossless = [c for c in candidates if not c.lossy]
    assert lossless and all(c.fits is False for c in lossless)  # every one planned over budget, or pruned by one
    assert any(c.plan is not None and c.plan.device_total_bytes > budget for c in lossless)
    path = write_config(TRAIN_CONFIG, overrides, best.changes, tmp_path / "fit.yaml")
    out = run_recipe_in_process(recipe, [f"output_dir={tmp_path / 'fit_run'}"], config=path)
    measured = json.loads((out / "memory_breakdown.json").read_text())["device_peak_bytes"]
    assert measured <= budget  # the tracker's peak of the real run
    # --lossless-only refuses instead
    assert best_of(search(cfg, module.SCHEMA, device_memory=budget, knobs=knobs, margin=0, lossy="never")) is None


def test_optimizer_offload_keeps_no_state_on_the_device_at_steps_0_and_1(tmp_path, tiny_checkpoint, tiny_data):
    module = load_recipe_module(find_recipe("full_single_device"))
    cfg = load_and_check(module, TRAIN_CONFIG, _tiny(tmp_path, tiny_checkpoint, tiny_data, {
        "device": "cuda", "optimizer_offload": "cpu"}) + ["~lora"])
    for plan in (plan_memory(cfg), plan_memory(cfg, fake=False)):  # fake tensors, and real ones on a CPU "host"
        # category peaks over both steps: the states were created on the host before step 0 and stepped there
        assert plan.device["optimizer_state"] == 0 and plan.at_peak["device"]["optimizer_state"] == 0
        assert plan.host["optimizer_state"] >= 2 * plan.parameters["trainable"] * 4  # two fp32 moments
        assert plan.device["temporaries"] < plan.host["optimizer_state"]  # nor the host step's temporaries


def test_fsdp_cpu_offload_keeps_shards_gradients_and_states_on_the_host_and_fit_offers_it():
    """FSDP2's CPU offload planned where it lives: rank 0's parameter shards, gradients and optimizer states move
    from the device (the plan without it, which the two-rank runs in test_plan check) to the host, byte for byte
    up to the allocator's rounding; the cost model charges its copies and host step; --fit at 2 ranks takes it
    exactly when the budget lies between the two plans."""
    from mtune.training.planning.cost import device_floor, step_cost

    module, overrides, cfg = shipped_on_tiny("llama3_1/8B_full_distributed")
    on_device = plan_memory(cfg, world_size=2)
    offloaded_cfg = load_and_check(module, find_config("llama3_1/8B_full_distributed"),
                                   overrides + ["fsdp_cpu_offload=true"])
    offloaded = plan_memory(offloaded_cfg, world_size=2)
    for category in ("parameters", "gradients", "optimizer_state"):
        assert on_device.device[category] > 0 and offloaded.device[category] == 0, category
        assert offloaded.host[category] == pytest.approx(on_device.device[category], rel=0.01), category
    moved = sum(on_device.device[c] for c in ("parameters", "gradients", "optimizer_state"))
    assert offloaded.device_peak_bytes <= on_device.device_peak_bytes - 0.9 * moved
    device, host = device_floor(offloaded_cfg, 2)
    assert not device and sum(host.values()) > 0  # nothing of the floor stays on the device
    assert step_cost(offloaded_cfg, world_size=2) > step_cost(cfg, world_size=2)  # the same FLOPs plus copies

    knobs = [k for k in KNOBS if k.name in ("fsdp_cpu_offload", "micro_batch")]
    budget = (offloaded.device_total_bytes + on_device.device_total_bytes) // 2  # with the CUDA context
    best = best_of(search(cfg, module.SCHEMA, device_memory=budget, world_size=2, knobs=knobs, margin=0))
    assert best is not None and best.changes.get("fsdp_cpu_offload") is True
    roomy = best_of(search(cfg, module.SCHEMA, device_memory=2 * on_device.device_total_bytes, world_size=2,
                           knobs=knobs, margin=0))
    assert roomy is not None and not roomy.changes.get("fsdp_cpu_offload")  # cheaper without the copies


def test_ranks_on_one_machine_share_its_host_memory(capsys):
    from pathlib import Path

    from mtune.training.planning.fit import fit_header

    host, _ = fit_header("lora_distributed", Path("x.yaml"), 24 << 30, 64 << 30, world_size=8)
    assert host == 8 << 30  # --nproc_per_node 8: each rank plans against an eighth of the machine's memory
    assert "8 ranks on this machine (8.00 GiB of host memory each)" in capsys.readouterr().out


def test_paged_states_are_managed_memory_outside_the_allocator(tmp_path, tiny_checkpoint, tiny_data):
    pytest.importorskip("bitsandbytes")
    module = load_recipe_module(find_recipe("full_single_device"))
    base = _tiny(tmp_path, tiny_checkpoint, tiny_data, {"device": "cuda"}) + ["~lora"]
    paged = plan_memory(load_and_check(module, TRAIN_CONFIG, base + [
        "optimizer._component_=bitsandbytes.optim.PagedAdamW"]), device_memory=1 << 30)
    plain = plan_memory(load_and_check(module, TRAIN_CONFIG, base))
    assert paged.device["optimizer_state"] == 0 and plain.device["optimizer_state"] > 0
    # the same states (the device's figure rounds each to the allocator's 512-byte blocks)
    assert paged.managed_bytes == pytest.approx(plain.device["optimizer_state"], rel=0.01)
    assert paged.managed_resident_bytes() == paged.managed_bytes and paged.paged_bytes() == 0
    assert paged.device_peak_bytes < plain.device_peak_bytes


@pytest.mark.parametrize("changes", [
    {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 2},
    {"enable_activation_checkpointing": True, "enable_activation_offloading": True,
     "activation_offloading_use_streams": False},
    {"lora.quantize_base": True},
    # weight offloading with every block checkpointed: two groups on the device (one prefetched) at any depth
    {"weight_offloading": "{type: block_level, blocks_per_group: 1, use_streams: true}",
     "enable_activation_checkpointing": True},
])
def test_the_fast_estimates_match_whole_plans(tmp_path, tiny_checkpoint, tiny_data, changes):
    module = load_recipe_module(find_recipe("lora_single_device"))
    overrides = _tiny(tmp_path, tiny_checkpoint, tiny_data, {"device": "cuda", **changes})
    cfg = load_and_check(module, TRAIN_CONFIG, overrides)
    estimator = Estimator(device_memory=None, host_memory=None)
    # a 2-block plan over the budget stands for the 8 blocks as a lower bound, without the 4-block plan
    bound = estimator.layered(cfg, n_layers=8, over=lambda plan: True)
    assert bound.lower_bound and estimator.planned == 1
    # planned in full afterwards, the 2-block plan is not run again: only the 4-block one (mutation checked:
    # without the estimator's per-depth cache it is 3)
    layered, whole = estimator.layered(cfg, n_layers=8), plan_memory(cfg, n_layers=8)
    assert estimator.planned == 2 and not layered.lower_bound
    assert "planned with 2 and 4 blocks, extrapolated to 8" in layered.estimated
    for name in ("device_peak_bytes", "host_peak_bytes"):  # 2 and 4 blocks extrapolated to 8
        assert getattr(layered, name) == pytest.approx(getattr(whole, name), rel=0.02), name
    assert bound.device_peak_bytes <= whole.device_peak_bytes and bound.host_peak_bytes <= whole.host_peak_bytes
    # micro-batches 4 and 2 planned (several per step), micro-batch 1 derived from them per sample
    # (an always-true ``and samples`` clause stood here; the amount is now checked: the line through the two
    # planned micro-batches, per sample. Mutation checked: deriving from the nearer point alone (t = 0 in
    # Estimator.estimate) fails the line's assertion.)
    planned_peaks = {}
    for batch in (4, 2):
        planned_peaks[batch] = estimator.estimate(load_and_check(module, TRAIN_CONFIG, overrides + [
            f"batch_size={batch}", f"gradient_accumulation_steps={8 // batch}"])).device_peak_bytes
    one = load_and_check(module, TRAIN_CONFIG, overrides + ["batch_size=1", "gradient_accumulation_steps=8"])
    derived = estimator.estimate(one)
    assert estimator.derived == 1 and "micro-batch 1 derived from 2 and 4 per sample" in derived.estimated
    per_sample = (planned_peaks[4] - planned_peaks[2]) / 2
    assert derived.device_peak_bytes == pytest.approx(planned_peaks[2] - per_sample, abs=2)
    assert derived.device_peak_bytes == pytest.approx(plan_memory(one).device_peak_bytes, rel=0.03)


def test_a_tie_goes_to_the_fewer_techniques_even_when_the_most_saving_one_fits(tmp_path, tiny_checkpoint, tiny_data,
                                                                               monkeypatch):
    from mtune.training.planning import candidates as candidates_module, judge as judge_module

    from mtune.training.planning.cost import StepCost

    # every candidate costs the same and moves as much: one tier per micro-batch
    monkeypatch.setattr(candidates_module, "step_costs", lambda cfg, paged_bytes=0.0, world_size=1: StepCost(1e-6, 0.0))
    monkeypatch.setattr(judge_module, "step_cost", lambda cfg, paged_bytes=0.0, world_size=1: 1e-6)
    module = load_recipe_module(find_recipe("lora_single_device"))
    cfg = load_and_check(module, TRAIN_CONFIG, _tiny(tmp_path, tiny_checkpoint, tiny_data, {}))
    knobs = [k for k in KNOBS if k.name in ("weight_offloading", "micro_batch")]
    # 64 MiB: every candidate fits, and offloading the ~6 MB of frozen weights is worth searching (over 2%)
    candidates = search(cfg, module.SCHEMA, device_memory=64 << 20, knobs=knobs, margin=0)
    best = best_of(candidates)
    # the tier is searched from its most-saving member down (leaf-level, block-level, none): each fits, and the
    # answer is the one with the fewest techniques
    assert best.changes.get("weight_offloading") is None and best.micro_batch == 4
    planned = {(c.changes.get("weight_offloading") or {}).get("type"): c.fits for c in candidates if c.plan}
    assert planned == {"leaf_level": True, "block_level": True, None: True}


def test_a_tie_of_levels_goes_to_the_fewer_bytes_moved_to_the_host():
    # Llama 3.1 8B QLoRA at 8 GiB (benchmarks/fit_answers.py): an fp8 base with leaf-level weight offloading and the
    # NF4 base with block-level cost the same (the transfers hide under compute in the cost model), hold as many
    # techniques and sum to the same levels (1 + 2 and 2 + 1); the one that moves half the bytes goes first
    from mtune.training.planning.candidates import Candidate
    from mtune.training.planning.fit import speed_key

    leaf_fp8 = Candidate({}, (1, 2, 1, 0), 1.22189e-4, micro_batch=8, transfer=1930592.5)
    block_nf4 = Candidate({}, (2, 1, 1, 0), 1.22189e-4, micro_batch=8, transfer=963648.0)
    assert speed_key(leaf_fp8)[:3] == speed_key(block_nf4)[:3] and speed_key(leaf_fp8)[4] == speed_key(block_nf4)[4]
    assert min([leaf_fp8, block_nf4], key=speed_key) is block_nf4
    assert min([block_nf4, leaf_fp8], key=speed_key) is block_nf4


def test_a_budget_below_the_floor_is_refused_without_a_plan(capsys):
    from mtune._cli.main import main

    code = main(["plan", "--fit", "--device-memory", "8GiB", "--host-memory", "64GiB", "full_single_device",
                 "--config", "llama3_1/8B_full_single_device", "model.checkpoint_dir=null", "model.family=llama3_1",
                 "model.size=8B", "tokenizer.path=null", "device=cuda", "--output", "/dev/null"])
    out = capsys.readouterr().out
    assert code == 1 and " 0 plans run" in out, out
    assert "bf16 trainable weights 14.96 GiB alone" in out and "nothing fits in 8.00 GiB" in out


def test_an_answer_that_drops_the_configs_quantized_base_says_so(tmp_path, tiny_checkpoint, tiny_data):
    # a QLoRA config whose bf16 base fits: not "the same numbers as the config", but nothing given up either
    module = load_recipe_module(find_recipe("lora_single_device"))
    overrides = _tiny(tmp_path, tiny_checkpoint, tiny_data, {"lora.quantize_base": True})
    qlora = load_and_check(module, TRAIN_CONFIG, overrides)
    lora = load_and_check(module, TRAIN_CONFIG, overrides + ["lora.quantize_base=false"])
    assert numerics_line(qlora, lora).startswith("more precise than the config: no NF4 base weights")
    assert numerics_line(qlora, qlora) == numerics_line(lora, lora) == "lossless: the same numbers as the config"
    # an fp8 base in its place (Llama 3.2 3B QLoRA's answer at 12 GiB): more precise, and the line names both
    fp8 = load_and_check(module, TRAIN_CONFIG, overrides + ["lora.quantize_base=false",
                                                            "weight_storage_dtype=float8_e4m3fn"])
    assert numerics_line(qlora, fp8) == ("more precise than the config: fp8 base weights where it had NF4 base "
                                         "weights (not the same numbers, nothing given up)")


def test_the_answers_last_lines_name_what_it_gives_up_and_the_config_written(tmp_path, tiny_checkpoint, tiny_data,
                                                                             capsys):
    """close_answer's lines: a lossless answer's numerics line comparing the config (QLoRA) with the answer (LoRA);
    a lossy answer's "gives up" list after its head; then where the config went and the command that runs the
    written file (not the user's). Mutations seen failing: the lossy branch dropped (numerics line always); the
    config and the answer swapped in numerics_line; the run command naming the user's config."""
    from types import SimpleNamespace

    from mtune.training.planning.answer import close_answer

    module = load_recipe_module(find_recipe("lora_single_device"))
    overrides = _tiny(tmp_path, tiny_checkpoint, tiny_data, {"lora.quantize_base": True})
    qlora = load_and_check(module, TRAIN_CONFIG, overrides)
    lora = load_and_check(module, TRAIN_CONFIG, overrides + ["lora.quantize_base=false"])
    out = tmp_path / "fit.yaml"
    kwargs = dict(recipe="lora_single_device", config_path=TRAIN_CONFIG, overrides=overrides, output=out)
    assert close_answer(qlora, SimpleNamespace(lossy=(), cfg=lora), {"lora.quantize_base": False}, "lossy: ",
                        **kwargs) == 0
    assert capsys.readouterr().out == (
        "  more precise than the config: no NF4 base weights (it fits without: not the same numbers, nothing given "
        f"up)\nwritten to {out}; run it with:\n  mtune run lora_single_device --config {out}\n")
    assert close_answer(lora, SimpleNamespace(lossy=("NF4 base weights", "8-bit optimizer states"), cfg=qlora),
                        {"lora.quantize_base": True}, "lossy (nothing lossless fits): ", **kwargs) == 0
    assert capsys.readouterr().out == (
        "  lossy (nothing lossless fits): gives up NF4 base weights, 8-bit optimizer states\n"
        f"written to {out}; run it with:\n  mtune run lora_single_device --config {out}\n")


def test_the_written_config_keeps_interpolations_and_replaces_a_node_whole(tmp_path):
    """write_config: the user's YAML with their override, a changed node replaced whole (the old optimizer's
    ``fused`` gone), a key the config lacked added, interpolations left as written; a header naming the source and
    the changes. Oracle: the YAML written out by hand. Mutations seen failing: ``merge=True`` (fused kept);
    ``to_yaml(resolve=True)``; the changes left out of the header."""
    from omegaconf import OmegaConf

    source = tmp_path / "mine.yaml"
    source.write_text("output_dir: /runs/a\nlog_dir: ${output_dir}/logs\nbatch_size: 4\n"
                      "optimizer:\n  _component_: torch.optim.AdamW\n  lr: 0.001\n  fused: true\n")
    changes = {"optimizer": {"_component_": "bitsandbytes.optim.AdamW8bit", "lr": 0.001},
               "enable_activation_checkpointing": True}
    out = write_config(source, ["batch_size=8"], changes, tmp_path / "fit.yaml")
    header, _, body = out.read_text().partition("\n")
    assert header == (f"# Written by `mtune plan --fit` from {source}; changed: optimizer=AdamW8bit "
                      "enable_activation_checkpointing=true")
    assert OmegaConf.to_container(OmegaConf.create(body)) == {
        "output_dir": "/runs/a", "log_dir": "${output_dir}/logs", "batch_size": 8,
        "optimizer": {"_component_": "bitsandbytes.optim.AdamW8bit", "lr": 0.001},
        "enable_activation_checkpointing": True}


@pytest.mark.parametrize("config", ["llama3_2/1B_lora_single_device", "llama3_1/8B_full_single_device"])
def test_no_candidates_floor_exceeds_its_own_plan(config):
    """--fit rejects a candidate whose floor passes a budget without planning it, so no floor may exceed the plan it
    stands for, on either budget: candidates of the search's knobs drawn at random (seeded) on the tiny model, each
    floor against its plan's device and host peaks (a block-level host floor and an fp8 device floor were over
    theirs before 2026-11-27)."""
    import random

    from mtune.training.planning.candidates import with_overrides
    from mtune.training.planning.cost import device_floor

    module, _, cfg = shipped_on_tiny(config)
    rng, options, checked = random.Random(0), [knob.choices(cfg) for knob in KNOBS], 0
    while checked < 12:
        overrides = {k: v for choices in options for k, v in rng.choice(choices).overrides.items()}
        candidate = with_overrides(cfg, overrides)
        if any(rule(candidate) for rule in module.SCHEMA.rules):  # a combination the search would not make
            continue
        device, host = device_floor(candidate)
        plan = plan_memory(candidate)
        assert sum(device.values()) <= plan.device_peak_bytes, overrides
        assert sum(host.values()) <= plan.host_peak_bytes, overrides
        checked += 1
