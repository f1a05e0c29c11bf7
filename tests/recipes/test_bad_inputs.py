"""Every mistake ends in one clear line: bad keys, values, files and directories, through the real CLI entry point
(in process). Each case exits non-zero, prints no traceback, names the key, file or directory, and `mtune
validate` gives the same verdict as `mtune run` wherever the config alone decides."""

import json

import pytest
import torch

from mtune._cli.main import main

CONFIG = "tiny/lora_single_device"

# (overrides, what the error line must contain); each is refused before a model is loaded
CONFIG_ERRORS = [
    (["dataset.sourse=my.jsonl"], "dataset.sourse: instruct_dataset does not accept 'sourse' (did you mean 'source'?)"),
    (["dataset.train_on_inpt=true"], "dataset.train_on_inpt: instruct_dataset does not accept 'train_on_inpt'"),
    (["clip_grad_norm=-1"], "clip_grad_norm: must be > 0 (or null), got -1"),
    (["epochs=0"], "epochs: must be >= 1, got 0"),
    (["max_steps_per_epoch=0"], "max_steps_per_epoch: must be >= 1 (or null), got 0"),
    (["gradient_accumulation_steps=0"], "gradient_accumulation_steps: must be >= 1, got 0"),
    (["optimizer.lr=-1"], "optimizer.lr: must be >= 0, got -1"),
    (["optimizer.lr=abc"], "optimizer.lr: expected a number, got str 'abc'"),
    (["batch_size=0"], "batch_size: must be >= 1, got 0"),
    (["keep_last_n_checkpoints=0"], "keep_last_n_checkpoints: must be >= 1 (or null), got 0"),
    (["lora.dropout=1.5"], "lora.dropout: must be >= 0 and < 1, got 1.5"),
    (["lora.alpha=0"], "lora.alpha: must be > 0, got 0"),
    (["device=cpux"], "device: 'cpux' is not valid"),
    (["lr_scheduler.num_warmup_steps=-2"], "lr_scheduler.num_warmup_steps: must be an integer >= 0, got -2"),
    (["dataset.train_on_input=maybe"], "dataset.train_on_input: instruct_dataset takes true or false, got str 'maybe'"),
    (["dataset.packed=1"], "dataset.packed: instruct_dataset takes true or false, got int 1"),
    (["overwrite_output_dir=maybe"], "overwrite_output_dir: expected bool, got str 'maybe'"),
]


def _cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("overrides,message", CONFIG_ERRORS, ids=[o[0] for o, _ in CONFIG_ERRORS])
def test_config_mistakes_are_one_line_in_run_and_validate(capsys, tmp_path, overrides, message):
    code, _, err = _cli(capsys, "run", "lora_single_device", "--config", CONFIG, f"output_dir={tmp_path}",
                        *overrides)
    assert code == 1 and "Traceback" not in err
    assert f"error: {message}" in err, err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing was written
    code, out, _ = _cli(capsys, "validate", CONFIG, f"output_dir={tmp_path}", *overrides)
    assert code == 1 and f"error: {message}" in out, out


def test_a_colon_in_a_text_value_stays_text(capsys):
    code, out, _ = _cli(capsys, "validate", "tiny/generate", "~messages", "prompt=Reverse the words: ink jar egg")
    assert code == 0, out
    code, out, _ = _cli(capsys, "validate", "tiny/generate", "~messages", "prompt=123")  # text: kept as written
    assert code == 0, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_missing_device_is_one_line(capsys, tmp_path):
    code, _, err = _cli(capsys, "run", "lora_single_device", "--config", CONFIG, f"output_dir={tmp_path}",
                        "device=cuda")
    assert code == 1 and "Traceback" not in err
    assert "error: device=cuda: this machine has no CUDA GPU" in err


def test_a_file_that_is_not_utf8_is_named(capsys, tmp_path):
    data = tmp_path / "latin1.jsonl"
    row = json.dumps({"instruction": "caf\u00e9", "output": "x"}, ensure_ascii=False)
    data.write_bytes(row.encode("latin-1") + b"\n")
    code, _, err = _cli(capsys, "run", "lora_single_device", "--config", CONFIG, f"output_dir={tmp_path / 'out'}",
                        f"dataset.source={data}", "task_eval=null")
    assert code == 1 and "Traceback" not in err
    assert f"error: dataset: {data}: not UTF-8 text (byte 0xe9 at offset" in err
    assert "hint: save the file as UTF-8" in err


def test_an_output_dir_holding_a_run_is_refused_and_kept(capsys, tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "mtune_state.json").write_text('{"step": 3, "complete": true}')
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
    code, _, err = _cli(capsys, "run", "lora_single_device", "--config", CONFIG, f"output_dir={tmp_path}")
    assert code == 1 and "Traceback" not in err
    assert f"error: output_dir={tmp_path} already holds a run (metrics.jsonl, final)" in err
    assert "hint: resume it with resume_from_checkpoint=true" in err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3, "loss": 1.0}\n'


def test_a_damaged_checkpoint_is_named_instead_of_starting_over(capsys, tmp_path):
    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / "mtune_state.json").write_text('{"step": 2, "comp')
    code, _, err = _cli(capsys, "run", "lora_single_device", "--config", CONFIG, f"output_dir={tmp_path}",
                        "resume_from_checkpoint=true", "task_eval=null")
    assert code == 1 and "Traceback" not in err
    assert f"error: {tmp_path / 'step_2' / 'mtune_state.json'}: corrupt, not JSON" in err


def test_warmup_longer_than_the_run_is_refused_before_the_first_step(capsys, tmp_path, tiny_checkpoint, tiny_data):
    from tests._helpers.recipes import TRAIN_CONFIG, train_overrides

    warmup = ["lr_scheduler._component_=mtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
              "lr_scheduler.num_warmup_steps=10000"]
    # 48 samples, batch 4, 2 epochs: 24 steps, known only once the dataset is read
    overrides = train_overrides(tmp_path, tiny_checkpoint, tiny_data, max_steps_per_epoch=None, epochs=2) + warmup
    code, out, _ = _cli(capsys, "validate", str(TRAIN_CONFIG), *overrides, "recipe=lora_single_device")
    assert code == 0 and "note: lr_scheduler.num_warmup_steps=10000: the run's total steps are known only once" in out
    code, _, err = _cli(capsys, "run", "lora_single_device", "--config", str(TRAIN_CONFIG), *overrides)
    assert code == 1 and "Traceback" not in err
    assert ("error: lr_scheduler.num_warmup_steps=10000 is not shorter than the run (12 steps per epoch x 2 epochs: "
            "24 steps)") in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    # cut short on purpose by max_steps_per_epoch (a smoke run of a real config): validate and run warn, not refuse
    code, out, _ = _cli(capsys, "validate", CONFIG, *warmup, "max_steps_per_epoch=100")
    assert code == 0 and ("warning: lr_scheduler.num_warmup_steps=10000 is not shorter than the run (at most "
                          "max_steps_per_epoch x epochs = 100 x 3: 300 steps)") in out


def test_mtune_run_leaves_the_warmup_to_the_run_so_it_is_said_once(capsys):
    from mtune._cli.catalog import find_recipe, load_recipe_module
    from mtune._cli.run import load_and_check
    from tests._helpers.recipes import TRAIN_CONFIG

    overrides = ["output_dir=/nonexistent/out", "lr_scheduler._component_=mtune.training.lr_schedulers."
                 "get_cosine_schedule_with_warmup", "lr_scheduler.num_warmup_steps=10", "max_steps_per_epoch=3"]
    load_and_check(load_recipe_module(find_recipe("lora_single_device")), TRAIN_CONFIG, overrides)
    assert "num_warmup_steps" not in capsys.readouterr().err  # the session's own line says it, with the exact total


def test_a_run_cut_short_by_max_steps_per_epoch_warns_about_its_warmup(caplog):
    from mtune.config import ConfigError
    from mtune.training.data_setup import StepPlan

    cfg = {"batch_size": 4, "epochs": 1, "max_steps_per_epoch": 3}
    short = StepPlan.from_config(cfg, batches_per_epoch=100)
    assert short.cut_short and short.total_steps == 3
    with caplog.at_level("WARNING", logger="mtune"):
        short.check_warmup(10)
    assert "num_warmup_steps=10 is not shorter than the run" in caplog.text and "cut this run short" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mtune"):
        short.check_warmup(10, warn=False)  # the other ranks of a distributed run: said once, by rank 0
    assert "num_warmup_steps" not in caplog.text
    whole = StepPlan.from_config(dict(cfg, max_steps_per_epoch=None), batches_per_epoch=5)
    with pytest.raises(ConfigError, match="num_warmup_steps=10 is not shorter than the run"):
        whole.check_warmup(10)


def test_a_chat_turn_with_an_unknown_role_is_one_line(capsys):
    code, out, err = _cli(capsys, "run", "generate", "--config", "tiny/generate", "~adapter_dir",
                          "messages=[{role: bot, content: hi}]")
    assert code == 1 and "Traceback" not in err and out == ""
    assert err.splitlines()[-1] == ("error: messages[0].role: 'bot' is not a chat role; use one of system, user, "
                                    "assistant, tool")


def test_a_config_for_another_recipe_says_so_first(capsys, tmp_path):
    code, _, err = _cli(capsys, "run", "full_single_device", "--config", CONFIG, f"output_dir={tmp_path}")
    assert code == 1 and "Traceback" not in err
    first = err.splitlines()[0]
    assert first.startswith("error: ") and first.endswith(
        "lora_single_device.yaml is a config for the recipe lora_single_device, not full_single_device (2 of its keys "
        "do not fit full_single_device, e.g. lora: unknown key)"), err
    assert "hint: mtune run lora_single_device --config " in err
