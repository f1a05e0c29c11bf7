"""`mtune plan`'s bad inputs end in one line naming the option, key or file, before any plan or search is spent:
unwritable --json / --png / --output paths, recipes that train nothing, --fit-only options without --fit (and the
plan's own files with it), a valued option followed by another option, a --fit budget the allocator's margin leaves
nothing of; command-line misuse exits 2, a host budget that the plan does not fit exits 1 as a device's does. In
process, on the tiny configs (through the real entry point, `mtune._cli.main.main`)."""

import pytest

from mtune._cli.main import main
from mtune._cli.plan_options import parse_plan_args
from mtune._cli.errors import UsageError

FS = ["full_single_device", "--config", "tiny/full_single_device"]


def _cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error(err: str) -> str:
    """The single `error:` line (and no traceback) of a refusal."""
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("flag", ["--json", "--png"])
def test_a_plan_file_in_a_missing_directory_is_refused_before_planning(capsys, tmp_path, flag):
    path = tmp_path / "nope" / ("plan.json" if flag == "--json" else "plan.png")
    code, out, err = _cli(capsys, "plan", flag, str(path), *FS, f"output_dir={tmp_path / 'x'}")
    assert code == 1
    assert _one_error(err) == (f"error: {flag} {path}: cannot write it: {path.parent}: No such file or directory")
    assert "mtune plan:" not in out  # refused before the plan


def test_a_json_path_that_is_a_directory_is_refused(capsys, tmp_path):
    code, out, err = _cli(capsys, "plan", "--json", str(tmp_path), *FS, f"output_dir={tmp_path / 'x'}")
    assert code == 1 and _one_error(err) == f"error: --json {tmp_path}: cannot write it: Is a directory"
    assert "mtune plan:" not in out


def test_a_png_that_is_not_a_png_is_refused(capsys, tmp_path):
    code, _, err = _cli(capsys, "plan", "--png", str(tmp_path / "plan.txt"), *FS, f"output_dir={tmp_path / 'x'}")
    assert code == 2 and "--png" in _one_error(err) and "name the file with .png" in err


def test_fit_output_in_a_missing_directory_is_refused_before_the_search(capsys, tmp_path):
    path = tmp_path / "nope" / "fit.yaml"
    code, out, err = _cli(capsys, "plan", "--fit", "--device-memory", "4GiB", "--output", str(path), *FS,
                          f"output_dir={tmp_path / 'x'}")
    assert code == 1
    assert _one_error(err) == f"error: --output {path}: cannot write it: {path.parent}: No such file or directory"
    assert "mtune plan --fit" not in out  # no search was run


def test_the_answer_that_cannot_be_written_is_one_line(tmp_path):
    """What the check before the search cannot foresee (the directory removed meanwhile) is one error too."""
    from mtune.errors import MtuneError
    from mtune.training.planning.answer import write_config
    from mtune._cli.catalog import find_config

    path = tmp_path / "gone" / "fit.yaml"
    with pytest.raises(MtuneError, match=f"cannot write the config --fit found to {path}: No such file or directory"):
        write_config(find_config("tiny/full_single_device"), [], {"batch_size": 2}, path)


@pytest.mark.parametrize("recipe,fit", [("generate", False), ("merge_lora", False), ("generate", True)])
def test_a_recipe_that_trains_nothing_is_refused(capsys, tmp_path, recipe, fit):
    fit_args = ["--fit", "--device-memory", "4GiB", "--output", str(tmp_path / "fit.yaml")] if fit else []
    code, _, err = _cli(capsys, "plan", *fit_args, recipe, "--config", f"tiny/{recipe}")
    command = "mtune plan --fit" if fit else "mtune plan"
    assert code == 2
    assert _one_error(err) == f"error: {command} plans the training recipes; {recipe} is not one (it trains nothing)"


def test_output_without_fit_is_refused_like_lossless_only(capsys, tmp_path):
    out_file = tmp_path / "x.yaml"
    code, _, err = _cli(capsys, "plan", "--output", str(out_file), *FS, f"output_dir={tmp_path / 'x'}")
    assert code == 2
    assert _one_error(err) == f"error: --output {out_file} is where --fit writes the config it finds: add --fit"
    assert not out_file.exists()
    code, _, err = _cli(capsys, "plan", "--lossless-only", *FS, f"output_dir={tmp_path / 'x'}")
    assert code == 2 and "add --fit" in _one_error(err)


def test_the_plans_own_files_with_fit_are_refused(capsys, tmp_path):
    code, _, err = _cli(capsys, "plan", "--fit", "--device-memory", "4GiB", "--json", str(tmp_path / "p.json"), *FS,
                        f"output_dir={tmp_path / 'x'}")
    assert code == 2 and _one_error(err).startswith("error: --json: it writes the plan of the config as given")


def test_a_host_that_does_not_fit_exits_1_as_a_device_does(capsys, tmp_path):
    args = ["plan", "--device-memory", "4GiB", *FS, f"output_dir={tmp_path / 'x'}", "optimizer_offload=cpu",
            "device=cuda"]
    code, out, _ = _cli(capsys, *args, "--host-memory", "1MiB")
    assert "host: does NOT fit in 1.0 MiB" in out and "device: fits in 4.00 GiB" in out
    assert code == 1
    code, out, _ = _cli(capsys, *args, "--host-memory", "1GiB")
    assert "host: fits in 1.00 GiB" in out and code == 0


def test_a_valued_option_does_not_take_the_next_option_as_its_value(capsys, tmp_path):
    with pytest.raises(UsageError, match=r"^--maximize needs a value \(one of seq_len\), not the option "
                                         r"--device-memory$"):
        parse_plan_args(["--fit", "--maximize", "--device-memory", "4GiB", *FS])
    with pytest.raises(UsageError, match=r"^--json needs a value \(a file to write\), not the option --fit$"):
        parse_plan_args(["--json", "--fit", *FS])
    code, _, err = _cli(capsys, "plan", "--fit", "--maximize", "--device-memory", "4GiB", *FS,
                        f"output_dir={tmp_path / 'x'}")
    assert code == 2 and _one_error(err).startswith("error: --maximize needs a value (one of seq_len)")


def test_a_fit_budget_within_the_allocator_margin_is_refused_before_the_search(capsys, tmp_path):
    for budget in ("40MiB", "1GiB"):  # 1 GiB on a CPU plan: the margin is kept on every target, as the search does
        code, out, err = _cli(capsys, "plan", "--fit", "--device-memory", budget, "--host-memory", "1MiB", *FS,
                              f"output_dir={tmp_path / 'x'}", "--output", str(tmp_path / "fit.yaml"))
        assert code == 2
        assert _one_error(err) == (f"error: --device-memory={budget} leaves nothing after the allocator's margin of "
                                   "1.00 GiB that --fit keeps: give more than 1.00 GiB")
        assert "mtune plan --fit" not in out and not (tmp_path / "fit.yaml").exists()


@pytest.mark.parametrize("argv,message", [
    (["--fit", "--maximize", "batch_size", "--device-memory", "4GiB"], "--maximize batch_size: --fit can maximize "
                                                                       "seq_len only"),
    (["--fit"], "--fit needs --device-memory SIZE (the memory of the device to fit, e.g. 24GiB)"),
])
def test_fit_command_line_misuse_exits_2(capsys, tmp_path, argv, message):
    code, out, err = _cli(capsys, "plan", *argv, *FS, f"output_dir={tmp_path / 'x'}",
                          "--output", str(tmp_path / "fit.yaml"))
    assert code == 2 and _one_error(err) == f"error: {message}"
    assert "mtune plan --fit" not in out


@pytest.mark.parametrize("argv, message", [
    (["--fit", "--device-memory", "4GiB", "--lossless-only", "--allow-lossy"],
     "--lossless-only and --allow-lossy contradict each other: give one"),
    (["--maximize", "seq_len"], "--maximize seq_len chooses what --fit maximizes: add --fit"),
    (["--fit", "--device-memory", "4GiB", "--from-data"],
     "--from-data with --fit: --fit searches at tokenizer.max_seq_len; run --from-data alone to see the longest "
     "batch, then --fit with tokenizer.max_seq_len=N"),
])
def test_option_combinations_that_cannot_both_hold_are_refused(argv, message):
    """Combinations of plan options that contradict or need --fit are one UsageError, before any config is read."""
    from mtune._cli.plan_options import check_options

    options, _ = parse_plan_args(argv)
    with pytest.raises(UsageError) as err:
        check_options(options)
    assert str(err.value) == message
