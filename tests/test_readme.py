"""The README's first command, exactly as written, on a fresh copy of the repository in a fresh virtual environment:
it installs mtune, fine-tunes the built-in tiny model, and the loss drops and the task accuracy rises."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OUTPUT_DIR = Path("/tmp/mtune/tiny_lora")  # the output_dir of recipes/configs/tiny/lora_single_device.yaml


def readme_commands() -> list[str]:
    """The two set-up commands: the lines of the README's first ```bash block (comments stripped)."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_names_the_test_command_ci_runs():
    assert readme_commands()[1] == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


@pytest.mark.slow
def test_readme_first_command_fine_tunes_the_tiny_model(tmp_path):
    command = readme_commands()[0]
    assert "mtune run lora_single_device --config tiny/lora_single_device" in command
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    fresh = tmp_path / "mtune"
    for name in files:  # what a fresh clone holds (and what is about to be committed)
        if (REPO / name).is_file():
            (fresh / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, fresh / name)
    shutil.rmtree(OUTPUT_DIR, ignore_errors=True)
    proc = subprocess.run(["bash", "-c", command], cwd=fresh, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((OUTPUT_DIR / "results.json").read_text())
    rows = [json.loads(line) for line in (OUTPUT_DIR / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < 0.5 * first, (first, last)
    before, after = results["task_eval_before"]["exact_match"], results["task_eval_after"]["exact_match"]
    assert before <= 0.1 and after >= 0.5, (before, after)
    assert (OUTPUT_DIR / "final" / "adapter" / "adapter_model.safetensors").is_file()
