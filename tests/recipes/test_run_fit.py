"""`mtune run --fit`: plans at launch with `mtune plan --fit`'s search, writes the chosen config into output_dir,
runs it and is held to --device-memory (its device_memory_limit); without a GPU and without a size it refuses in one
line."""

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests._helpers.paths import REPO
from tests._helpers.recipes import read_metrics

GIB = 2**30


def _mtune_run(*argv):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_QUIET": "1"}
    return subprocess.run([sys.executable, "-m", "mtune", "run", *argv], capture_output=True, text=True, env=env,
                          timeout=600)


def test_run_fit_plans_writes_runs_and_stays_under_the_device_memory(tmp_path):
    out = tmp_path / "out"
    # 1100 MiB less the allocator margin (1 GiB) leaves 76 MiB: rows of 512 tokens as configured plan 155.5 MiB, with
    # activation checkpointing 60.6 MiB (`mtune plan`), so the answer turns checkpointing on.
    done = _mtune_run("--fit", "--device-memory", "1100MiB", "--host-memory", "4GiB", "lora_single_device", "--config",
                      "tiny/lora_single_device", f"output_dir={out}", "epochs=1", "max_steps_per_epoch=2",
                      "batch_size=4", "tokenizer.max_seq_len=512", "task_eval=null", "plan_check=false",
                      "lr_scheduler.num_warmup_steps=0", "log_every_n_steps=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mtune plan --fit: lora_single_device" in done.stdout and "into 1.07 GiB" in done.stdout
    assert "\nanswer: enable_activation_checkpointing=true\n" in done.stdout  # what changed, then why it fits
    assert f"written to {out / 'mtune_fit.yaml'}" in done.stdout
    assert f"mtune run --fit: running lora_single_device with {out / 'mtune_fit.yaml'}" in done.stderr
    written = OmegaConf.load(out / "mtune_fit.yaml")
    assert written.enable_activation_checkpointing is True  # the answer, run
    assert written.device_memory_limit == "1100MiB" and written.max_steps_per_epoch == 2  # the limit, the overrides
    assert "activation_checkpointing=block" in done.stderr  # the run's own list of techniques
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["peak_tensor_gib"] * GIB <= 1100 * 2**20 for r in rows)  # tracked under the limit every step
    assert (out / "final").is_dir()


def test_run_fit_without_a_gpu_or_a_size_refuses_in_one_line(tmp_path):
    done = _mtune_run("--fit", "lora_single_device", "--config", "tiny/lora_single_device",
                      f"output_dir={tmp_path / 'out'}", "device=cpu")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --fit: the run's device is cpu, whose memory mtune cannot read as a GPU's: give "
                      "--device-memory SIZE (or set device_memory_limit=SIZE)"], done.stderr
    assert not (tmp_path / "out").exists()


def _run_in_process(capsys, *argv):
    from mtune._cli.main import main

    code = main(["run", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


def test_run_fit_refuses_a_recipe_that_trains_nothing(capsys):
    code, errors = _run_in_process(capsys, "--fit", "--device-memory", "4GiB", "generate", "--config", "tiny/generate")
    assert code == 2
    assert errors == ["error: mtune run --fit plans the training recipes; generate is not one (it trains nothing)"]


def test_run_fit_refuses_a_budget_within_the_allocator_margin_before_the_search(capsys, tmp_path):
    out = tmp_path / "out"
    code, errors = _run_in_process(capsys, "--fit", "--device-memory", "512MiB", "lora_single_device", "--config",
                                   "tiny/lora_single_device", f"output_dir={out}")
    assert code == 2 and errors == ["error: --device-memory=512MiB leaves nothing after the allocator's margin of "
                                    "1.00 GiB that --fit keeps: give more than 1.00 GiB"]
    code, errors = _run_in_process(capsys, "--fit", "lora_single_device", "--config", "tiny/lora_single_device",
                                   f"output_dir={out}", "device_memory_limit=512MiB")
    assert code == 1 and errors == ["error: device_memory_limit=512MiB leaves nothing after the allocator's margin of "
                                    "1.00 GiB that --fit keeps: give more than 1.00 GiB"]
    assert not out.exists()


def test_run_fit_budget_does_not_take_the_next_option_as_its_value(capsys):
    code, errors = _run_in_process(capsys, "--fit", "--device-memory", "--host-memory", "4GiB", "lora_single_device",
                                   "--config", "tiny/lora_single_device")
    assert code == 2 and errors == ["error: --device-memory needs a value, e.g. --device-memory 24GiB, not the option "
                                    "--host-memory"]


def test_run_fit_refuses_an_output_dir_it_cannot_create_before_the_search(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"  # under a file: no directory can be made there
    code, errors = _run_in_process(capsys, "--fit", "--device-memory", "2GiB", "lora_single_device", "--config",
                                   "tiny/lora_single_device", f"output_dir={out}")
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"error: output_dir={out}: cannot create it, where --fit writes mtune_fit.yaml: ")


def test_run_fit_hands_the_budgets_to_the_search_and_runs_nothing_when_nothing_fits(monkeypatch, tmp_path):
    """The search receives --device-memory and --host-memory as bytes (2 GiB, 3 GiB) for one rank, and a search
    that found nothing (status 1) gives no config to run. Mutations checked: the host budget not passed on; a
    failed search's status ignored."""
    from mtune._cli.catalog import find_recipe, load_recipe_module
    from mtune._cli.run_fit import fit_at_launch
    from mtune.training.planning import fit

    seen = {}

    def fake_fit_command(cfg, **kwargs):
        seen.update(kwargs)
        return 1

    monkeypatch.setattr(fit, "fit_command", fake_fit_command)
    module = load_recipe_module(find_recipe("lora_single_device"))
    answer = fit_at_launch(module, "lora_single_device", REPO / "recipes" / "configs" / "tiny" / "lora_single_device.yaml",
                           [f"output_dir={tmp_path / 'out'}"], {"--device-memory": "2GiB", "--host-memory": "3GiB"})
    assert answer is None
    assert (seen["device_memory"], seen["host_memory"], seen["world_size"]) == (2 * GIB, 3 * GIB, 1)


def test_run_fit_refuses_an_output_dir_holding_a_run_before_the_search(monkeypatch, tmp_path):
    """An output_dir that holds a run is refused as the run would refuse it, but before the search is spent (and
    before mtune_fit.yaml is written there). Mutation checked: the early refusal dropped."""
    from mtune._cli.catalog import find_recipe, load_recipe_module
    from mtune._cli.run_fit import fit_at_launch
    from mtune.errors import OutputExistsError
    from mtune.training.planning import fit

    searched = []
    monkeypatch.setattr(fit, "fit_command", lambda cfg, **kwargs: searched.append(1) or 1)
    (tmp_path / "out" / "final").mkdir(parents=True)  # a finished run
    module = load_recipe_module(find_recipe("lora_single_device"))
    with pytest.raises(OutputExistsError, match=r"already holds a run \(final\)"):
        fit_at_launch(module, "lora_single_device", REPO / "recipes" / "configs" / "tiny" / "lora_single_device.yaml",
                      [f"output_dir={tmp_path / 'out'}"], {"--device-memory": "2GiB"})
    assert searched == [] and not (tmp_path / "out" / "mtune_fit.yaml").exists()
