"""`mtune download` against the small hub-compatible HTTP server in tests/_helpers/hub_server.py (no network): files
arrive byte for byte, and every failure (gated, missing, refused connection, broken transfer, unsafe names,
unwritable output) is one `error:` line naming the repo, without a traceback."""

import os
import subprocess
import sys

import pytest

from tests._helpers.hub_server import FILES, REPO_ID, Hub, start
from tests._helpers.paths import REPO


@pytest.fixture(scope="module")
def hub():
    state = Hub()
    server = start(state)
    yield state
    server.shutdown()


@pytest.fixture
def download(hub, tmp_path):
    hub.files, hub.mode = dict(FILES), "ok"

    def run(*args, endpoint=None, no_pauses=False):
        """``mtune download REPO_ID *args`` in a subprocess; ``no_pauses`` skips huggingface_hub's one-second waits
        between retries (time.sleep does nothing in that process)."""
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("HF_")}
        env.pop("MTUNE_DEBUG", None)
        env.update(
            PYTHONPATH=str(REPO), HF_ENDPOINT=endpoint or hub.endpoint, HF_HOME=str(tmp_path / "hf_home"),
            HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_XET="1",
            HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5",
        )
        entry = "import sys, time; from mtune._cli.main import main; sys.exit(main(sys.argv[1:]))"
        if no_pauses:
            entry = entry.replace("main;", "main; time.sleep = lambda seconds: None;")
        return subprocess.run([sys.executable, "-c", entry, "download", REPO_ID, *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=90)

    return run


def one_error(out) -> str:
    """The `error:` line of a failed run, after checking that it failed cleanly (exit 1, no traceback)."""
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def test_files_arrive_byte_for_byte(download, tmp_path):
    out = download("--output-dir", tmp_path / "out")
    assert out.returncode == 0, out.stderr
    for name, data in FILES.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    assert f"downloaded {REPO_ID} to {tmp_path / 'out'} (4 files):" in out.stdout
    assert "  tokenizer/tokenizer.json" in out.stdout.splitlines()


def test_allow_and_ignore_patterns(download, tmp_path):
    out = download("--output-dir", tmp_path / "out", "--allow-patterns", "*.json", "*.md",
                   "--ignore-patterns", "tokenizer/*")
    assert out.returncode == 0, out.stderr
    got = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")
                 if p.is_file() and ".cache" not in p.parts)
    assert got == ["README.md", "config.json"]


def test_gated_repo_says_accept_the_licence(download, hub, tmp_path):
    hub.mode = "gated"
    out = download("--output-dir", tmp_path / "out")
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"error: {REPO_ID} is gated: you must accept its licence before downloading",
        f"hint: accept it at https://huggingface.co/{REPO_ID}, then set HF_TOKEN (or pass --hf-token)",
    ]


def test_missing_repo(download, hub, tmp_path):
    hub.mode = "missing"
    assert one_error(download("--output-dir", tmp_path / "out")).startswith(
        f"error: repository {REPO_ID} not found on the hub")


def test_refused_connection_names_the_endpoint_and_the_repo(download, tmp_path):
    out = download("--output-dir", tmp_path / "out", endpoint="http://127.0.0.1:9")  # discard port: nobody listens
    line = one_error(out)
    assert line.startswith(f"error: cannot reach the hub at http://127.0.0.1:9 to download {REPO_ID}"), line
    assert "refused" in line.lower(), line
    assert "hint: check the network connection" in out.stderr


def test_an_output_dir_holding_files_is_not_reported_downloaded_when_the_hub_is_unreachable(download, tmp_path):
    """huggingface_hub returns a non-empty local_dir as it is when the hub cannot be reached (a warning only). Before,
    the command then printed `downloaded ... (1 files)` and exited 0 with nothing downloaded."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("from before")
    out = download("--output-dir", tmp_path / "out", endpoint="http://127.0.0.1:9")
    line = one_error(out)
    assert line.startswith(f"error: cannot reach the hub at http://127.0.0.1:9 to download {REPO_ID}"), line
    assert (tmp_path / "out" / "old.txt").read_text() == "from before"


def test_a_download_into_a_directory_holding_files_completes_it(download, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("from before")
    out = download("--output-dir", tmp_path / "out")
    assert out.returncode == 0, out.stderr
    for name, data in FILES.items():
        assert (tmp_path / "out" / name).read_bytes() == data


def test_transfer_cut_short_is_one_line(download, hub, tmp_path):
    hub.mode = "truncated"  # after its retries huggingface_hub lets its HTTP client's transport error through
    line = one_error(download("--output-dir", tmp_path / "out", no_pauses=True))
    assert line.startswith(f"error: downloading {REPO_ID} from {hub.endpoint} failed: "), line


def test_unwritable_output_dir(download, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    line = one_error(download("--output-dir", tmp_path / "file" / "out"))
    assert line.startswith(f"error: cannot write {REPO_ID} to {tmp_path / 'file' / 'out'}"), line


def test_dotdot_in_listing_is_never_written_outside_dir(download, hub, tmp_path):
    hub.files["../escape.txt"] = b"outside"
    hub.files["sub/../../escape2.txt"] = b"outside"
    assert "unsafe file name" in one_error(download("--output-dir", tmp_path / "out"))
    written = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert not {"escape.txt", "escape2.txt"} & written


def test_invalid_repo_id(hub, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "hf")}
    env.pop("MTUNE_DEBUG", None)
    out = subprocess.run([sys.executable, "-m", "mtune", "download", "a/b/c", "--output-dir", tmp_path / "out"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert one_error(out).startswith("error: 'a/b/c' is not a valid repository id"), out.stderr


def test_download_loads_no_heavy_module_at_start():
    code = ("import sys; from mtune._cli.main import _commands; _commands()['download']; "
            "print(sorted(m for m in ('torch', 'huggingface_hub', 'httpx', 'httpx2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"
