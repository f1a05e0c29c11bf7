"""`mtune` ls / cp / validate / run through the real entry point (subprocesses)."""

import json
import re
import subprocess
import sys

from tests._helpers.paths import REPO

LIGHT = """
import sys
from mtune._cli.main import main
for argv in (["--help"], ["ls"], ["run", "--help"], ["cp", "--help"], ["validate", "--help"],
             ["download", "--help"], ["cp", "test/echo", sys.argv[1]], ["validate", "test/echo"]):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "transformers", "huggingface_hub", "numpy") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_light_commands_do_not_import_torch(recipes_root, tmp_path):
    env = {"PYTHONPATH": str(REPO), "MTUNE_RECIPES_DIR": str(recipes_root), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", LIGHT, str(tmp_path / "c.yaml")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert "usage: mtune <command>" in out.stdout and "valid for recipe echo_recipe" in out.stdout


def test_ls_is_derived_from_the_configs_recipe_keys(mtune):
    out = mtune("ls")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert rows[0] == ["RECIPE", "CONFIGS"]
    assert ["allreduce_recipe", "test/allreduce"] in rows
    assert ["echo_recipe", "test/broken"] in rows and ["test/echo"] in rows
    assert ["ghost_recipe", "(no", "such", "recipe)", "other/orphan"] in rows


def test_cp_copies_and_refuses_to_overwrite(mtune, recipes_root, tmp_path):
    out = mtune("cp", "test/echo", tmp_path / "mine.yaml")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "mine.yaml").read_bytes() == (recipes_root / "configs/test/echo.yaml").read_bytes()
    out = mtune("cp", "echo_recipe", tmp_path)  # into a directory
    assert out.returncode == 0 and (tmp_path / "echo_recipe.py").read_bytes() == (
        recipes_root / "echo_recipe.py").read_bytes()
    (tmp_path / "mine.yaml").write_text("edited")
    out = mtune("cp", "test/echo.yaml", tmp_path / "mine.yaml")
    assert out.returncode == 1 and "already exists" in out.stderr and "--force" in out.stderr
    assert (tmp_path / "mine.yaml").read_text() == "edited"
    assert mtune("cp", "--force", "test/echo", tmp_path / "mine.yaml").returncode == 0
    assert (tmp_path / "mine.yaml").read_text().startswith("# Test config")
    out = mtune("cp", "test/ecoh", tmp_path / "x.yaml")
    assert out.returncode == 1 and "did you mean 'test/echo'" in out.stderr


def test_cp_to_a_place_it_cannot_write_is_one_line(mtune, tmp_path):
    """DEST under a file, or a directory where the copy would go (with --force): one line naming DEST, exit 1.
    Before: mkdir's FileExistsError / copyfile's IsADirectoryError as a traceback."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "d" / "echo.yaml").mkdir(parents=True)
    for args in (("test/echo", tmp_path / "a_file" / "mine.yaml"), ("--force", "test/echo", tmp_path / "d")):
        out = mtune("cp", *args)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"error: cannot write {tmp_path}/"), out.stderr
        assert "hint: choose another DEST" in out.stderr


def test_validate_good_config_with_path_warning(mtune, tmp_path):
    out = mtune("validate", "test/echo", "component=argparse.Namespace", f"component.data_files=[{tmp_path}/a.json]")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"warning: component.data_files: path does not exist: {tmp_path}/a.json" in out.stdout
    assert "valid for recipe echo_recipe" in out.stdout
    # components a config would call from outside mtune, torch, torchao and bitsandbytes are listed
    assert "components from outside mtune, torch, torchao and bitsandbytes" in out.stdout
    assert "  component: argparse.Namespace" in out.stdout.splitlines()


def test_validate_lists_every_problem(mtune):
    out = mtune("validate", "test/broken")
    assert out.returncode == 1
    errors = [line for line in out.stdout.splitlines() if line.startswith("error: ")]
    assert "error: component._component_: cannot import 'fractions.Fractoin': 'fractions' has no attribute " \
           "'Fractoin' (did you mean 'fractions.Fraction'?)" in errors
    assert "error: enable_activation_checkpionting: unknown key (did you mean " \
           "'enable_activation_checkpointing'?)" in errors
    assert "error: dtype: must be one of fp32, bf16, fp16, got 'fp8'" in errors
    assert "error: batch_size: expected int, got str 'two'" in errors
    assert any(e.startswith("error: log_dir: cannot resolve its value") for e in errors)
    assert len(errors) == 6  # log_dir is also an unknown key for this recipe
    out = mtune("validate", "test/echo", "optimizer_in_bwd=true", "gradient_accumulation_steps=4")
    assert out.returncode == 1
    assert ("error: optimizer_in_bwd=true cannot be combined with gradient_accumulation_steps=4: "
            "set gradient_accumulation_steps=1 or optimizer_in_bwd=false") in out.stdout


def test_run_applies_overrides_and_fills_defaults(mtune, tmp_path):
    out = mtune("run", "echo_recipe", "--config", "test/echo", f"output_dir={tmp_path}/out",
                "component.numerator=5", "seed=7", "~batch_size")
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "out" / "echo.json").read_text())
    assert result["built"] == "5/4"
    assert result["cfg"]["seed"] == 7 and result["cfg"]["batch_size"] == 4 and result["cfg"]["dtype"] == "bf16"
    # a recipe and a config given by path work the same way
    out = mtune("run", REPO / "tests/assets/recipes/echo_recipe.py", "--config", REPO / "tests/assets/configs/echo.yaml",
                f"output_dir={tmp_path}/out2", "component=fractions.Fraction", "component.denominator=8")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "out2" / "echo.json").read_text())["built"] == "3/8"


def test_run_errors_are_one_line_with_a_hint(mtune, tmp_path):
    out = mtune("run", "echo_recipe", "--config", "test/echo", "--lr", "3")
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: unexpected option '--lr' after the recipe",
        "hint: after RECIPE, write config overrides as key=value, e.g. lr=VALUE",
    ]
    out = mtune("run", "echo_recipe", "--config", "test/echo", "batch_sise=3")
    assert out.returncode == 1 and "error: batch_sise: unknown key (did you mean 'batch_size'?)" in out.stderr
    assert "Traceback" not in out.stderr
    out = mtune("run", "--nproc_per_node", "2", "echo_recipe", "--config", "test/echo")
    assert out.returncode == 1 and "error: recipe 'echo_recipe' does not support distributed runs" in out.stderr
    for command, value in (("run", "two"), ("run", "0"), ("plan", "-1")):
        out = mtune(command, "--nproc_per_node", value, "echo_recipe", "--config", "test/echo")
        assert out.returncode == 2 and out.stderr.startswith(f"error: --nproc_per_node {value}: expected a positive"), \
            out.stderr
    out = mtune("run", "echo_recipee", "--config", "test/echo")
    assert out.returncode == 1 and "did you mean 'echo_recipe'" in out.stderr
    out = mtune("run", "echo_recipe", "--config", "test/echo", "batch_size=two", MTUNE_DEBUG="1")
    assert out.returncode == 1 and "Traceback" in out.stderr and "ConfigError" in out.stderr
    # a component that raises inside its own call: the key, the target and the error, no traceback
    out = mtune("run", "echo_recipe", "--config", "test/echo", f"output_dir={tmp_path}/zero", "component.denominator=0")
    assert out.returncode == 1 and out.stderr.splitlines()[-2:] == [
        "error: component: fractions.Fraction raised ZeroDivisionError: Fraction(3, 0)",
        "hint: check component in the config; MTUNE_DEBUG=1 shows the traceback"], out.stderr


def test_run_help_prints_the_recipe_keys(mtune):
    out = mtune("run", "echo_recipe", "--help")
    assert out.returncode == 0, out.stderr
    assert "enable_activation_checkpointing" in out.stdout and "[fp32|bf16|fp16, default bf16]" in out.stdout
    assert "distributed: no" in out.stdout


def test_run_two_processes_under_torchrun(mtune, tmp_path):
    out = mtune("run", "--nproc_per_node", "2", "allreduce_recipe", "--config", "test/allreduce",
                f"output_dir={tmp_path}", OMP_NUM_THREADS="1")
    assert out.returncode == 0, out.stderr
    records = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["sum"]) for r in records] == [(0, 2, 3.0), (1, 2, 3.0)]


def test_a_torchrun_worker_ends_after_its_atexit_callbacks_without_the_interpreter_teardown(mtune, tmp_path):
    """The interpreter's teardown freed the process group that torch's DTensor caches kept past
    destroy_process_group, with its gloo threads running: now and then a rank that had trained and saved aborted
    (`terminate called without an active exception`). A worker now leaves once its atexit callbacks ran."""
    out = mtune("run", "--nproc_per_node", "2", "allreduce_recipe", "--config", "test/allreduce",
                f"output_dir={tmp_path}", OMP_NUM_THREADS="1", TEST_TEARDOWN_MARKS="1")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob("atexit_*")) == ["atexit_0", "atexit_1"]
    assert not list(tmp_path.glob("finalized_*"))


def test_a_dead_rank_ends_in_one_summary_naming_it_the_latest_checkpoint_and_the_resume_command(mtune, tmp_path):
    from mtune.training.checkpointing.checkpoint_dir import CheckpointWriter

    CheckpointWriter(tmp_path).save(step=3, epoch=0, config={}, kind="hf_full", write_fn=lambda d: None)
    out = mtune("run", "--nproc_per_node", "2", "allreduce_recipe", "--config", "test/allreduce",
                f"output_dir={tmp_path}", OMP_NUM_THREADS="1", TEST_KILL_RANK="1")
    assert out.returncode != 0
    error, hint = out.stderr.splitlines()[-2:]
    assert re.fullmatch(r"error: rank 1 \(pid \d+\) was killed by SIGKILL \(signal 9\): kill -9, or the kernel's "
                        r"out-of-memory killer \(`dmesg \| grep -i oom` tells which\); the other ranks were stopped"
                        r"( \(1 of them failed after it\))?", error), error
    assert hint == (f"hint: the latest complete checkpoint is {tmp_path / 'step_3'}; resume from it: mtune run "
                    f"--nproc_per_node 2 allreduce_recipe --config test/allreduce output_dir={tmp_path} "
                    "resume_from_checkpoint=true"), hint


def test_the_summary_blames_the_rank_that_failed_not_the_ones_torchrun_stopped_with_sigterm(tmp_path):
    from mtune._cli.rank_failures import summary

    # torchrun records the ranks it stopped with SIGTERM beside the one that failed, stamped to the same second.
    def report(agent, errors=()):
        for path in tmp_path.glob("*.json"):
            path.unlink()
        (tmp_path / "agent_1.json").write_text(json.dumps(
            [{"rank": r, "local_rank": r, "pid": 100 + r, "exitcode": code, "signal": sig, "timestamp": 7}
             for r, code, sig in agent]))
        for rank, message in errors:
            (tmp_path / f"rank_{rank}.json").write_text(json.dumps(
                {"type": "OutOfMemoryError", "message": message, "time": 7.5, "pid": 100 + rank}))
        return summary(tmp_path, output_dir=None, command=["mtune", "run"])[0]

    assert report([(0, -15, "SIGTERM"), (1, -9, "SIGKILL")]).startswith("error: rank 1 (pid 101) was killed by SIGKILL")
    assert report([(0, -15, "SIGTERM"), (1, 1, None)], [(1, "CUDA out of memory")]) == \
        "error: rank 1 (pid 101) ran out of memory: CUDA out of memory; the other ranks were stopped (1 of them " \
        "failed after it)"
    # a SIGTERM still outranks a rank whose collective broke because its peer went away
    assert report([(0, 1, None), (1, -15, "SIGTERM")], [(0, "Connection closed by peer")]).startswith(
        "error: rank 1 (pid 101) was killed by SIGTERM (signal 15);")


def test_a_ranks_mtune_error_is_summed_up_with_its_own_hint_not_a_resume(tmp_path):
    """Bad data, a resume the config cannot make, a damaged checkpoint: running or resuming the same command meets
    the same error, so the summary gives the error's own hint (the resume hint named the command that had just
    failed, or the damaged checkpoint), and none when it has none."""
    from mtune._cli.rank_failures import summary
    from mtune.training.checkpointing.checkpoint_dir import CheckpointWriter

    CheckpointWriter(tmp_path / "out").save(step=1, epoch=0, config={}, kind="lora", write_fn=lambda d: None)
    (tmp_path / "agent_1.json").write_text(json.dumps(
        [{"rank": r, "local_rank": r, "pid": 100 + r, "exitcode": 1, "signal": None, "timestamp": 7} for r in (0, 1)]))

    def lines(rank0, rank1):
        for rank, record in enumerate((rank0, rank1)):
            (tmp_path / f"rank_{rank}.json").write_text(json.dumps({"time": 7.5 + rank, "pid": 100 + rank, **record}))
        return summary(tmp_path, output_dir=str(tmp_path / "out"), command=["mtune", "run", "x"])

    damaged = {"type": "DamagedCheckpointError", "message": "checkpoint out/step_1 is damaged: ...", "user_error": True,
               "hint": "no earlier intact checkpoint in out: start again in another output_dir"}
    lost = {"type": "RuntimeError", "message": "[gloo] Connection closed by peer", "user_error": False, "hint": None}
    assert lines(lost, damaged) == [
        "error: rank 1 (pid 101) stopped: checkpoint out/step_1 is damaged: ...; the other ranks were stopped (1 of "
        "them failed after it)", "hint: no earlier intact checkpoint in out: start again in another output_dir"]
    assert lines({**damaged, "hint": None}, lost) == [
        "error: rank 0 (pid 100) stopped: checkpoint out/step_1 is damaged: ...; the other ranks were stopped (1 of "
        "them failed after it)"]
    crash = {"type": "ValueError", "message": "boom", "user_error": False, "hint": None}  # not mtune's: resume it
    assert lines(crash, lost)[1] == (f"hint: the latest complete checkpoint is {tmp_path / 'out' / 'step_1'}; resume "
                                     "from it: mtune run x resume_from_checkpoint=true")


def test_run_fit_options_go_before_the_recipe_and_need_fit():
    import pytest

    from mtune._cli.errors import UsageError
    from mtune._cli.run import parse_run_args

    args = parse_run_args(["--fit", "--device-memory", "24GiB", "--host-memory=23GiB", "lora_single_device",
                           "--config", "c.yaml", "lora.rank=4"])
    assert args.fit and args.fit_budgets == {"--device-memory": "24GiB", "--host-memory": "23GiB"}
    assert args.launcher == [] and args.recipe == "lora_single_device" and args.overrides == ["lora.rank=4"]
    with pytest.raises(UsageError, match="--device-memory sets what --fit plans for: add --fit before it"):
        parse_run_args(["--device-memory", "24GiB", "lora_single_device", "--config", "c.yaml"])
    with pytest.raises(UsageError, match="--host-memory needs a value"):
        parse_run_args(["--fit", "--host-memory"])
    with pytest.raises(UsageError, match="unexpected option '--fit' after the recipe"):
        parse_run_args(["lora_single_device", "--config", "c.yaml", "--fit"])


def test_a_second_config_is_refused_not_put_in_place_of_the_first():
    """Two --config (any spelling) used to run the last one, exit 0."""
    import pytest

    from mtune._cli.errors import UsageError
    from mtune._cli.run import parse_run_args

    assert parse_run_args(["lora_single_device", "--config=a.yaml", "k=v"]).config == "a.yaml"
    for argv in (["--config", "a.yaml", "--config", "b.yaml"], ["--config=a.yaml", "-c", "b.yaml"],
                 ["-c", "a.yaml", "k=v", "--config=b.yaml"]):
        with pytest.raises(UsageError, match=r"^--config given twice \(a.yaml, b.yaml\)$"):
            parse_run_args(["lora_single_device", *argv])


def test_output_piped_into_a_reader_that_leaves_ends_quietly(recipes_root):
    """`mtune run RECIPE --help | head -3` ended in a BrokenPipeError traceback."""
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO), "MTUNE_RECIPES_DIR": str(recipes_root)}
    script = "\n".join(["import sys", "from mtune._cli.main import main", "for _ in range(2000):",  # > a pipe's buffer
                        "    code = main(['ls'])", "    if code:", "        sys.exit(code)"])
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.readline()
    proc.stdout.close()  # the reader leaves while mtune still writes
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and stderr == "", stderr[-2000:]


def test_a_config_that_is_a_directory_is_named_as_one(tmp_path):
    """It said "no config file or built-in config named '<dir>'"."""
    import pytest

    from mtune._cli.catalog import find_config
    from mtune._cli.errors import CliError

    (tmp_path / "a.yaml").write_text("recipe: x\n")
    with pytest.raises(CliError) as err:
        find_config(str(tmp_path))
    assert str(err.value) == f"{tmp_path} is a directory, not a config file"
    assert err.value.hint == "name a YAML file in it (such as a.yaml)"
    assert find_config(str(tmp_path / "a.yaml")) == tmp_path / "a.yaml"
