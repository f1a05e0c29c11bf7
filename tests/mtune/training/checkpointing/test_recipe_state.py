import random

import numpy as np
import pytest
import torch

from mtune.training.checkpointing.recipe_state import (
    MAY_CHANGE_ON_RESUME,
    MUST_MATCH_ON_RESUME,
    RECIPE_STATE_FILENAME,
    ResumeError,
    check_resume_compatible,
    load_recipe_state,
    save_recipe_state,
)
from mtune.training.lr_schedulers import get_cosine_schedule_with_warmup
from mtune.training.rng import get_rng_state, set_rng_state, set_seed


class CountingLoader:
    """Holds a position like mtune's data loader does (epoch, samples consumed)."""

    def __init__(self):
        self.epoch, self.consumed = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state):
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def _build():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=10)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, loader, steps):
    for _ in range(steps):
        x = torch.randn(4, 8)  # data drawn from the torch RNG, dropout too
        noise = random.random() + float(np.random.rand())
        loss = (model(x) ** 2).mean() * noise
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loader.consumed += 4


def _draws():
    return (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2, 2).tolist())


def test_rng_state_round_trip_is_bit_exact():
    set_seed(123)
    state = get_rng_state()
    first = _draws()
    _draws()
    set_rng_state(state)
    assert _draws() == first


def test_resume_continues_bit_for_bit(tmp_path):
    set_seed(0)
    model, optimizer, scheduler = _build()
    loader = CountingLoader()
    _train(model, optimizer, scheduler, loader, 3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lr_at_save = optimizer.param_groups[0]["lr"]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    path = save_recipe_state(tmp_path, step=3, epoch=0, optimizer=optimizer, lr_scheduler=scheduler,
                             grad_scaler=scaler, dataloader=loader, extra={"tokens_seen": 96})
    assert path == tmp_path / RECIPE_STATE_FILENAME
    _train(model, optimizer, scheduler, loader, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_draws = _draws()

    set_seed(999)  # a fresh process would start from some other state
    model2, optimizer2, scheduler2 = _build()
    model2.load_state_dict(weights)
    loader2, scaler2 = CountingLoader(), torch.amp.GradScaler("cpu")
    state = load_recipe_state(tmp_path, optimizer=optimizer2, lr_scheduler=scheduler2, grad_scaler=scaler2,
                              dataloader=loader2)
    assert (state.step, state.epoch, state.extra) == (3, 0, {"tokens_seen": 96})
    assert loader2.state_dict() == {"epoch": 0, "consumed": 12}
    assert scaler2.get_scale() == 1024.0
    assert scheduler2.last_epoch == 3 and optimizer2.param_groups[0]["lr"] == lr_at_save != 1e-2
    _train(model2, optimizer2, scheduler2, loader2, 3)
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert _draws() == expected_draws
    assert loader2.consumed == 24


def test_missing_state_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="recipe_state.pt is missing"):
        load_recipe_state(tmp_path)
    save_recipe_state(tmp_path, step=1, epoch=0)
    with pytest.raises(ValueError, match="holds no optimizer state, but one was passed to load it into"):
        load_recipe_state(tmp_path, optimizer=_build()[1])


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a torch file"])
def test_an_unreadable_state_is_one_line_naming_the_file(tmp_path, damage):
    """With verify_checksums=false (or checksums gone) a damaged recipe_state.pt reached torch.load: a 46-line
    traceback ("PytorchStreamReader failed reading zip archive")."""
    from mtune.training.checkpointing.manifest import DamagedCheckpointError

    path = save_recipe_state(tmp_path, step=1, epoch=0)
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[: len(raw) // 2], "empty": b"", "not a torch file": b"step: 1\n"}[damage])
    with pytest.raises(DamagedCheckpointError) as err:
        load_recipe_state(tmp_path)
    assert str(err.value).startswith(f"{path} is unreadable: ") and "\n" not in str(err.value)
    assert err.value.hint.startswith("resume from an earlier checkpoint")


SAVED = {
    "recipe": "lora_finetune_single_device",
    "model": {"checkpoint_dir": "/m"},
    "lora": {"modules": ["q_proj", "v_proj"], "rank": 8, "alpha": 16},
    "dtype": "bf16", "batch_size": 2, "gradient_accumulation_steps": 4, "seed": 1,
    "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4},
    "dataset": {"source": "a.jsonl"},
    "epochs": 1, "max_steps_per_epoch": None, "log_every_n_steps": 1, "save_every_n_steps": 10,
    "output_dir": "/out", "metric_logger": None, "profiler": {"enabled": False},
    "enable_activation_checkpointing": False,
}


def test_changes_that_do_not_alter_training_may_resume():
    cfg = dict(SAVED, epochs=3, max_steps_per_epoch=50, log_every_n_steps=5, save_every_n_steps=2,
               output_dir="/elsewhere", metric_logger={"_component_": "mtune.training.observe.metric_logging.TensorBoardLogger"},
               profiler={"enabled": True}, enable_activation_checkpointing=True, resume_from_checkpoint=True)
    check_resume_compatible(SAVED, cfg)
    assert not set(MUST_MATCH_ON_RESUME) & set(MAY_CHANGE_ON_RESUME)


def test_refusal_lists_every_differing_key():
    cfg = dict(SAVED, batch_size=4, lora=dict(SAVED["lora"], rank=16), seed=2,
               optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-4, "weight_decay": 0.1},
               new_unknown_key=1, epochs=5)
    with pytest.raises(ResumeError) as info:
        check_resume_compatible(SAVED, cfg, checkpoint="/out/step_10")
    assert str(info.value) == (
        "Cannot resume from checkpoint /out/step_10: these keys differ from its config and change training: "
        "batch_size (2 -> 4), lora.rank (8 -> 16), new_unknown_key (absent -> 1), optimizer.lr (0.0001 -> 0.0002), "
        "optimizer.weight_decay (absent -> 0.1), seed (1 -> 2). Set them back, or start a new run in another "
        "output_dir.")


def test_a_key_added_after_the_checkpoint_resumes_at_its_off_value():
    """A checkpoint written before `reference_storage_dtype` or `dataset.packed` existed resumes with them at null /
    false (what the run did), and is refused with them on. (Seen failing with every absent key counted as a change.)"""
    check_resume_compatible(SAVED, dict(SAVED, reference_storage_dtype=None, dataset=dict(SAVED["dataset"],
                                                                                          packed=False)))
    with pytest.raises(ResumeError, match=r"reference_storage_dtype \(absent -> 'float8_e4m3fn'\)"):
        check_resume_compatible(SAVED, dict(SAVED, reference_storage_dtype="float8_e4m3fn"))


def test_a_different_global_batch_is_refused_whatever_the_ranks():
    # 2 ranks x 2 = 4 samples per step: 1 rank x 4 keeps it; 1 rank x 2 (the same per-rank batch) halves it
    check_resume_compatible(SAVED, dict(SAVED, batch_size=4), saved_world_size=2, world_size=1)
    with pytest.raises(ResumeError, match=r"global batch = batch_size x ranks \(2 x 2 = 4 -> 2 x 1 = 2\)"):
        check_resume_compatible(SAVED, SAVED, saved_world_size=2, world_size=1)


def test_every_declared_key_is_classified_for_resume():
    from mtune.config import keys
    from mtune.training.memory import registry

    groups = [keys.RUN_KEYS, registry.MEMORY_KEYS, keys.MODEL_NODES, keys.TRAINING_NODES, registry.LORA_KEYS,
              keys.DISTRIBUTED_KEYS]
    names = {decl.name for group in groups for decl in group.keys}
    classified = set(MUST_MATCH_ON_RESUME) | set(MAY_CHANGE_ON_RESUME)
    assert names - classified == set()


def test_fp8_storage_must_match_and_the_checkpointing_policy_may_change_on_resume():
    # selective_op computes the same numbers as block (tests/mtune/training/memory/test_selective_checkpointing.py);
    # fp8 storage rounds the base weights every later step computes with.
    saved = dict(SAVED, activation_checkpointing_policy="block", weight_storage_dtype=None,
                 weight_storage_skip_patterns=[])
    check_resume_compatible(saved, dict(saved, activation_checkpointing_policy="selective_op"))
    with pytest.raises(ResumeError, match=r"weight_storage_dtype \(None -> 'float8_e4m3fn'\)"):
        check_resume_compatible(saved, dict(saved, weight_storage_dtype="float8_e4m3fn"))
    with pytest.raises(ResumeError, match=r"weight_storage_skip_patterns"):
        check_resume_compatible(saved, dict(saved, weight_storage_skip_patterns=["model.layers.0.*"]))


def test_set_seed_seeds_every_generator_as_its_own_seeding_does():
    """Oracle: each library's own seeded generator."""
    set_seed(1234)
    assert random.random() == random.Random(1234).random()
    assert np.random.rand(3).tolist() == np.random.RandomState(1234).rand(3).tolist()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1234)))


def test_rng_state_keeps_numpys_cached_normal():
    """numpy's legacy normals come in pairs: the state captured between them holds the second, bit for bit."""
    set_seed(7)
    np.random.standard_normal()  # draws two, returns one, caches the other
    state = get_rng_state()
    expected = np.random.standard_normal(3).tolist()
    set_seed(8)
    set_rng_state(state)
    assert np.random.standard_normal(3).tolist() == expected


def test_a_key_or_batch_size_dropped_from_the_config_is_a_difference_and_tuples_are_lists():
    """A key the new config lacks changes training too (named with its saved value); YAML lists and tuples agree."""
    cfg = {k: v for k, v in SAVED.items() if k not in ("lora", "batch_size")}
    with pytest.raises(ResumeError) as info:
        check_resume_compatible(SAVED, cfg)
    assert "batch_size (2 -> None), lora ({'modules': ['q_proj', 'v_proj'], 'rank': 8, 'alpha': 16} -> absent)" \
        in str(info.value)
    check_resume_compatible(SAVED, dict(SAVED, lora=dict(SAVED["lora"], modules=("q_proj", "v_proj"))))
