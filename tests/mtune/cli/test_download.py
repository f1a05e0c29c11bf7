"""`mtune download` against a small hub-compatible HTTP server on 127.0.0.1 (what huggingface_hub 2.4 asks for:
GET /api/models/{repo}/revision/{rev}, GET /api/models/{repo}/tree/{sha}?recursive=..., HEAD and GET
/{repo}/resolve/{sha}/{file}; errors are mapped from the X-Error-Code header)."""

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.mtune.cli.conftest import REPO

REPO_ID = "tiny-org/tiny-model"
SHA = "0123456789abcdef0123456789abcdef01234567"
FILES = {
    "config.json": b'{"hidden_size": 256}\n',
    "model.safetensors": bytes(range(256)) * 40,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# tiny\n",
}


class Hub:
    """What the server serves: ``files`` for ``REPO_ID``, or an error ``mode`` ('gated', 'missing')."""

    def __init__(self):
        self.files, self.mode, self.requests = dict(FILES), "ok", []


def make_handler(hub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, body=b"", headers=None, head=False):
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, data, status=200, headers=None, head=False):
            self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})}, head)

        def handle_any(self, head):
            path = self.path.split("?")[0]
            hub.requests.append(f"{self.command} {self.path}")
            if hub.mode == "gated":
                return self._json({"error": "Access to this repo is restricted."}, 401, {"X-Error-Code": "GatedRepo"}, head)
            if hub.mode == "missing" or not path.startswith((f"/api/models/{REPO_ID}/", f"/{REPO_ID}/")):
                return self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"}, head)
            if re.fullmatch(rf"/api/models/{REPO_ID}/revision/[^/]+", path):
                return self._json({"id": REPO_ID, "sha": SHA, "siblings": [{"rfilename": f} for f in hub.files]})
            if path == f"/api/models/{REPO_ID}/tree/{SHA}":
                return self._json([
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in hub.files.items()
                ])
            prefix = f"/{REPO_ID}/resolve/{SHA}/"
            if path.startswith(prefix) and path[len(prefix):] in hub.files:
                data = hub.files[path[len(prefix):]]
                headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
                return self._send(200, data, headers, head)
            return self._json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"}, head)

        def do_GET(self):
            self.handle_any(head=False)

        def do_HEAD(self):
            self.handle_any(head=True)

    return Handler


@pytest.fixture(scope="module")
def hub():
    state = Hub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()


@pytest.fixture
def download(hub, tmp_path):
    hub.files, hub.mode = dict(FILES), "ok"

    def run(*args, endpoint=None):
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("HF_")}
        env.update(
            PYTHONPATH=str(REPO), HF_ENDPOINT=endpoint or hub.endpoint, HF_HOME=str(tmp_path / "hf_home"),
            HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_XET="1",
            HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5",
        )
        return subprocess.run([sys.executable, "-m", "mtune", "download", REPO_ID, *map(str, args)], env=env,
                              capture_output=True, text=True, timeout=60)

    return run


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
        f"hint: accept it at https://huggingface.co/{REPO_ID}, then pass --hf-token (or set HF_TOKEN)",
    ]


def test_missing_repo(download, hub, tmp_path):
    hub.mode = "missing"
    out = download("--output-dir", tmp_path / "out")
    assert out.returncode == 1 and f"error: repository {REPO_ID} not found on the hub" in out.stderr


def test_unreachable_hub(download, tmp_path):
    out = download("--output-dir", tmp_path / "out", endpoint="http://127.0.0.1:9")
    assert out.returncode == 1 and f"error: cannot reach the hub to download {REPO_ID}" in out.stderr


def test_dotdot_in_listing_is_never_written_outside_dir(download, hub, tmp_path):
    hub.files["../escape.txt"] = b"outside"
    hub.files["sub/../../escape2.txt"] = b"outside"
    out = download("--output-dir", tmp_path / "out")
    assert out.returncode == 1 and "unsafe file name" in out.stderr
    written = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert not {"escape.txt", "escape2.txt"} & written
