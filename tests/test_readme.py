"""The README's commands are the tested ones: CI installs exactly as the README says before anything else (and
scripts/smoke_install.sh runs a few steps of the first command on that install alone, no test extras), the README's
test command is what CI runs, and the README's first command's fine-tune, run as written (only ``output_dir`` moved to
this test's temporary directory) on a fresh copy of the repository, gives the results the README states."""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

# What the README says the first command gives, and how it says it (the CPUs it names were measured).
FIRST_LOSS = 2.1          # "about 2.1": the first logged step
LAST_LOSS = (0.2, 0.3)    # the last step
EXACT_MATCH_BEFORE = 0.0
EXACT_MATCH_AFTER = (0.95, 0.98)
README_RESULTS = ("the loss falls from about 2.1 to 0.2–0.3 and exact-match accuracy on 100 held-out prompts rises "
                  "from 0% to 95–98%")


def readme_commands() -> list[str]:
    """The two set-up commands: the lines of the README's first ```bash block (comments stripped)."""
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_names_the_test_command_ci_runs():
    assert readme_commands()[1] == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_ci_installs_as_the_readme_says_before_the_test_extras():
    """.ci/run's commands, in order: the README's two pip installs (no extras), the versions they installed, the smoke
    test, the test command."""
    installs = [part.strip() for part in readme_commands()[0].split("&&") if part.strip().startswith("pip install")]
    assert installs == ["pip install torch==2.13.0", "pip install ."]
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    steps = [line for line in lines if "pip install" in line or line.startswith("bash ")]
    assert steps == [
        "python3 -m pip install -q torch==2.13.0",
        "python3 -m pip install -q .",
        "bash scripts/print_versions.sh",
        "bash scripts/smoke_install.sh",
        "bash scripts/test.sh",
    ]


def test_readme_states_the_results_this_test_checks():
    assert README_RESULTS in " ".join(README.split()), "the README's results sentence changed: update this test too"


@pytest.mark.slow
def test_readme_first_command_gives_the_readme_results(tmp_path):
    # The install before it is CI's own first steps (the test above); a fresh virtual environment here would repeat
    # them at a minute of the suite's time.
    command = readme_commands()[0].split("&&")[-1].strip()
    assert command == "mtune run lora_single_device --config tiny/lora_single_device", command
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    fresh = tmp_path / "mtune"
    for name in files:  # what a fresh clone holds (and what is about to be committed)
        if (REPO / name).is_file():
            (fresh / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, fresh / name)
    output_dir = tmp_path / "tiny_lora"
    env = {**os.environ, "PYTHONPATH": str(fresh)}  # mtune and its recipes from the copy, not this checkout
    where = subprocess.run(["python3", "-c", "import mtune; print(mtune.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(fresh), where
    proc = subprocess.run(["bash", "-c", f"{command} output_dir={shlex.quote(str(output_dir))}"], cwd=fresh, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((output_dir / "results.json").read_text())
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert rows[-1]["step"] == 375
    assert abs(first - FIRST_LOSS) < 0.1, first
    assert LAST_LOSS[0] <= last <= LAST_LOSS[1], last
    before, after = results["task_eval_before"]["exact_match"], results["task_eval_after"]["exact_match"]
    assert before == EXACT_MATCH_BEFORE, before
    assert EXACT_MATCH_AFTER[0] <= after <= EXACT_MATCH_AFTER[1], after
    assert (output_dir / "final" / "adapter" / "adapter_model.safetensors").is_file()
