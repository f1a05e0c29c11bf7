"""Exact resume (issue: checkpoints). Each variant trains 8 steps (2 epochs of 4, a cosine schedule with warmup)
uninterrupted, saving every 2 steps; a second run resumes from step_2 (mid-epoch) or step_6 (mid second epoch) and
must log the same losses, bit for bit, and end with the same parameters. fp32 on CPU."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from mtune.training.checkpointing.recipe_state import ResumeError
from tests._helpers.recipes import REPO, TRAIN_CONFIG, losses, read_metrics, run_recipe_in_process, train_overrides

SCHEDULE = ["epochs=2", "max_steps_per_epoch=4", "save_every_n_steps=2",
            "lr_scheduler._component_=mtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "lr_scheduler.num_warmup_steps=2"]

VARIANTS = {
    "full": ("full_single_device", ["~lora"]),
    "full_optimizer_in_bwd": ("full_single_device", ["~lora", "optimizer_in_bwd=true"]),
    "lora": ("lora_single_device", []),
    "lora_accumulation": ("lora_single_device", ["batch_size=2", "gradient_accumulation_steps=2"]),
    "lora_optimizer_in_bwd": ("lora_single_device", ["optimizer_in_bwd=true"]),
    "dora_dropout": ("lora_single_device", ["lora.use_dora=true", "lora.dropout=0.1"]),
    "qlora": ("lora_single_device", ["lora.quantize_base=true"]),
}


def _final_params(out, recipe):
    sub = "adapter/adapter_model.safetensors" if recipe == "lora_single_device" else "model/model.safetensors"
    return load_file(out / "final" / sub)


def _assert_same_params(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_is_exact(tmp_path, tiny_checkpoint, tiny_data, variant):
    recipe, extra = VARIANTS[variant]
    reference = run_recipe_in_process(recipe, train_overrides(tmp_path / "ref", tiny_checkpoint, tiny_data)
                                      + SCHEDULE + extra)
    full_run = losses(reference)
    assert len(full_run) == 8
    resume_at = 6 if variant == "lora" else 2  # mid-epoch 2 once, mid-epoch 1 for the rest
    resumed = run_recipe_in_process(
        recipe, train_overrides(tmp_path / "resumed", tiny_checkpoint, tiny_data) + SCHEDULE + extra
        + [f"resume_from_checkpoint={reference / f'step_{resume_at}'}"])
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == list(range(resume_at + 1, 9))
    assert losses(resumed) == full_run[resume_at:]  # bit for bit
    _assert_same_params(_final_params(reference, recipe), _final_params(resumed, recipe))


def test_resume_refuses_a_config_that_changes_training(tmp_path, tiny_checkpoint, tiny_data):
    out = run_recipe_in_process("lora_single_device", train_overrides(tmp_path, tiny_checkpoint, tiny_data)
                                + ["max_steps_per_epoch=2", "save_every_n_steps=2"])
    with pytest.raises(ResumeError, match=r"batch_size \(4 -> 2\).*lora.rank \(8 -> 4\)"):
        run_recipe_in_process("lora_single_device", train_overrides(tmp_path, tiny_checkpoint, tiny_data)
                              + ["resume_from_checkpoint=true", "batch_size=2", "lora.rank=4"])
    # keys that do not change what a step computes may change
    run_recipe_in_process("lora_single_device", train_overrides(tmp_path, tiny_checkpoint, tiny_data)
                          + ["resume_from_checkpoint=true", "max_steps_per_epoch=3", "keep_last_n_checkpoints=1"])
    assert read_metrics(out)[-1]["step"] == 3


def test_keep_last_n_checkpoints(tmp_path, tiny_checkpoint, tiny_data):
    out = run_recipe_in_process("lora_single_device", train_overrides(tmp_path, tiny_checkpoint, tiny_data)
                                + ["save_every_n_steps=1", "keep_last_n_checkpoints=2"])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_5", "step_6"]


def _cli(overrides, env_extra=None, wait=True):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "mtune", "run", "full_single_device", "--config", str(TRAIN_CONFIG), "~lora",
           *overrides]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        proc.wait(timeout=600)
    return proc


@pytest.mark.slow
def test_crash_during_a_save_and_sigterm_resume_exactly(tmp_path, tiny_checkpoint, tiny_data):
    reference = run_recipe_in_process("full_single_device", ["~lora"] + train_overrides(
        tmp_path / "ref", tiny_checkpoint, tiny_data) + SCHEDULE)
    expected = losses(reference)

    # Killed while writing step_4 (after the files, before the rename): step_2 stays the latest complete one.
    crash = train_overrides(tmp_path / "crash", tiny_checkpoint, tiny_data) + SCHEDULE
    proc = _cli(crash, {"MTUNE_FAULT_INJECT": "before_rename@4"})
    assert proc.returncode == 137
    out = tmp_path / "crash" / "out"
    assert (out / "step_2").is_dir() and not (out / "step_4").exists()
    assert any(p.name.startswith(".tmp_step_4") for p in out.iterdir())
    proc = _cli(crash + ["resume_from_checkpoint=true"])
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert not any(p.name.startswith(".tmp_") for p in out.iterdir())  # the half-written one was cleaned up
    assert losses(out)[-6:] == expected[2:]  # metrics.jsonl appends: steps 1-3 before the crash, then 3-8

    # SIGTERM mid-run: the step in flight finishes, a checkpoint is written, the process exits 0. 48 steps, so the
    # signal (sent once the first step is logged) arrives long before the end even when steps take milliseconds.
    long_schedule = ["epochs=12"] + SCHEDULE[1:2] + SCHEDULE[3:] + ["save_every_n_steps=1000"]
    expected = losses(run_recipe_in_process("full_single_device", ["~lora"] + train_overrides(
        tmp_path / "term_ref", tiny_checkpoint, tiny_data) + long_schedule))
    term = train_overrides(tmp_path / "term", tiny_checkpoint, tiny_data) + long_schedule
    out = tmp_path / "term" / "out"
    proc = _cli(term, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and read_metrics(out)):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    saved = sorted(p.name for p in out.iterdir() if p.name.startswith("step_"))
    assert len(saved) == 1 and not (out / "final").exists()
    stopped_at = int(saved[0].split("_")[1])
    assert 1 <= stopped_at < 48
    proc = _cli(term + ["resume_from_checkpoint=true"])
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert losses(out)[stopped_at:] == expected[stopped_at:]


def test_start_from_an_adapter_and_merge_it_like_the_run_did(tmp_path, tiny_checkpoint, tiny_data):
    from tests._helpers.recipes import REPO as repo

    first = run_recipe_in_process("lora_single_device", train_overrides(tmp_path / "first", tiny_checkpoint, tiny_data)
                                  + ["max_steps_per_epoch=2", "lora.use_dora=true"])
    adapter = first / "final" / "adapter"
    # lr 0: the second run starts from the saved adapter and cannot move it, so it saves it back unchanged
    second = run_recipe_in_process("lora_single_device", train_overrides(tmp_path / "second", tiny_checkpoint,
                                   tiny_data) + ["max_steps_per_epoch=1", "lora.use_dora=true", "optimizer.lr=0",
                                                 f"lora.adapter_dir={adapter}"])
    _assert_same_params(load_file(adapter / "adapter_model.safetensors"),
                        load_file(second / "final" / "adapter" / "adapter_model.safetensors"))
    # merge_lora on the saved adapter writes exactly the merged model the run wrote itself
    merged = tmp_path / "merged"
    run_recipe_in_process("merge_lora", [f"output_dir={merged}", f"adapter_dir={adapter}",
                                         f"base_model_dir={tiny_checkpoint}"],
                          config=repo / "recipes" / "configs" / "tiny" / "merge_lora.yaml")
    _assert_same_params(load_file(first / "final" / "model" / "model.safetensors"),
                        load_file(merged / "model.safetensors"))


def test_a_resume_with_another_length_stops_at_its_total_in_the_right_epoch_with_a_continuous_schedule(
        tmp_path, tiny_checkpoint, tiny_data):
    """2 epochs x 4 steps saved at steps 3 and 6, then resumed shorter (2 steps per epoch: step 3 falls in the
    second epoch and the run ends at step 4), longer (3 epochs) and past its new total (refused)."""
    schedule = SCHEDULE[:2] + SCHEDULE[3:] + ["save_every_n_steps=3"]
    reference = run_recipe_in_process("lora_single_device", train_overrides(tmp_path / "ref", tiny_checkpoint,
                                                                            tiny_data) + schedule)
    lr = {row["step"]: row["lr"] for row in read_metrics(reference)}

    def resumed(name, step, *changes):
        out = run_recipe_in_process("lora_single_device", train_overrides(tmp_path / name, tiny_checkpoint, tiny_data)
                                    + schedule + list(changes)
                                    + [f"resume_from_checkpoint={reference / f'step_{step}'}"])
        return read_metrics(out)

    shorter = resumed("shorter", 3, "max_steps_per_epoch=2")
    assert [(r["step"], r["epoch"]) for r in shorter] == [(4, 1)]  # was steps 4, 5 of 4, the second in no epoch
    assert shorter[0]["lr"] == pytest.approx(lr[4])  # the step after the resume keeps the saved run's lr

    longer = resumed("longer", 6, "epochs=3")
    assert [(r["step"], r["epoch"]) for r in longer] == [(7, 1), (8, 1), (9, 2), (10, 2), (11, 2), (12, 2)]
    rates = [r["lr"] for r in longer]
    assert rates[0] == pytest.approx(lr[7]) and all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] > 0

    with pytest.raises(ResumeError, match=r"it is at step 6, past this run's 4 steps \(2 per epoch x 2 epochs\)"):
        resumed("past", 6, "max_steps_per_epoch=2")


def test_a_stop_during_the_evaluation_before_training_drops_it_and_leaves_the_output_dir_free(tmp_path):
    """Ctrl-C in the task eval before training waited for it (a minute on a large eval set), then trained a step
    and saved it. Now the eval stops at once, nothing is trained or saved, the run exits 0, and the same command
    may start again in the same output_dir."""
    from mtune.training.context import run_outputs

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mtune", "run", "lora_single_device", "--config", "tiny/lora_single_device",
           f"output_dir={out}", "epochs=1"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the evaluation announces itself, then generates for a few seconds
        seen.append(line)
        if "task eval before training" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, "".join(seen) + rest
    assert "Received SIGINT: stopping the task eval before training" in rest, rest
    assert "task eval before training: stopped by a signal, no scores" in rest, rest
    assert not any(p.name.startswith(("step_", "final")) for p in out.iterdir())
    assert run_outputs(out) == []  # the same command may start again there


# RunLength on its own (no recipe run): the numbers worked out by hand from the formula in its module docstring.

def test_run_length_composes_a_second_change_and_refuses_one_step_past_the_total():
    """Saved at step 6 of a run already stretched (8 schedule steps laid over 10 from step 4, at position 4): the
    schedule stood at 4 + 2 x (8 - 4) / (10 - 4) = 16/3, where the new layout over 12 steps starts. Step 13 of a
    12-step run is past it; a run laid over no steps stays where it was."""
    from mtune.training.data_setup import StepPlan
    from mtune.training.run_length import RunLength

    plan = StepPlan(steps_per_epoch=4, epochs=3, samples_per_step=2)
    saved = {"schedule_steps": 8, "total_steps": 10, "resumed_at": 4, "position": 4.0}
    after = RunLength.resumed(plan, {"step": 6, "run_length": saved}, "ckpt", cfg={}, batches_per_epoch=4,
                              world_size=1)
    assert (after.schedule_steps, after.total_steps, after.resumed_at) == (8, 12, 6)
    assert after.position == pytest.approx(16 / 3, abs=1e-12)
    assert after.at(9) == pytest.approx(16 / 3 + 3 * (8 - 16 / 3) / (12 - 6), abs=1e-12)
    with pytest.raises(ResumeError, match=r"it is at step 13, past this run's 12 steps \(4 per epoch x 3 epochs\)"):
        RunLength.resumed(plan, {"step": 13, "run_length": saved}, "ckpt", cfg={}, batches_per_epoch=4, world_size=1)
    assert RunLength(8, 6, 6, 5.0).at(6) == 5.0


def test_run_length_of_a_checkpoint_saved_before_layouts_were_recorded_comes_from_its_config():
    """No run_length in mtune_state.json: the saved run's epochs and max_steps_per_epoch (2 x 4 = 8 steps) give the
    length that the new 3 x 4 = 12 steps stretch, from step 4 at position 4."""
    from mtune.training.data_setup import StepPlan
    from mtune.training.run_length import RunLength

    cfg = {"epochs": 3, "max_steps_per_epoch": 4, "batch_size": 2}
    plan = StepPlan.from_config(cfg, batches_per_epoch=10)
    state = {"step": 4, "config": {"epochs": 2, "max_steps_per_epoch": 4, "batch_size": 2}}
    assert RunLength.resumed(plan, state, "ckpt", cfg=cfg, batches_per_epoch=10, world_size=1) == \
        RunLength(8, 12, 4, 4.0)


def test_a_run_laid_back_onto_its_first_length_still_follows_the_laid_over_schedule():
    """8 schedule steps over 8 run steps, but from step 6 at position 5 (two changes of length): step 7 is position
    5 + (8 - 5) / (8 - 6) = 6.5, so the scheduler is re-laid; an unchanged run is left alone."""
    from torch.optim.lr_scheduler import LambdaLR

    from mtune.training.run_length import RunLength

    def scheduler():
        return LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), lambda s: float(s))

    laid = scheduler()
    RunLength(8, 8, 6, 5.0).apply(laid, "ckpt")
    assert laid.lr_lambdas[0](7) == 6.5
    unchanged = scheduler()
    RunLength(8, 8).apply(unchanged, "ckpt")
    assert unchanged.lr_lambdas[0](7) == 7.0
