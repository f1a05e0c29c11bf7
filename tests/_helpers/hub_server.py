"""A small Hugging Face Hub-compatible HTTP server on 127.0.0.1, for `mtune download` without a network.

It answers what ``huggingface_hub.snapshot_download`` (2.x) asks for: ``GET /api/models/{repo}/revision/{rev}``,
``GET /api/models/{repo}/tree/{sha}`` and ``HEAD``/``GET /{repo}/resolve/{sha}/{file}``. Errors carry the
``X-Error-Code`` header, from which huggingface_hub picks its error class (``GatedRepo``, ``RepoNotFound``,
``EntryNotFound``).

Standard library only, so that it also runs before the test extras are installed (CI's install smoke test):

    python3 tests/_helpers/hub_server.py --repo-id tiny-org/tiny-model --from-dir mtune/assets/tiny/model \\
        --endpoint-file /tmp/hub_endpoint     # serves until killed; the file gets http://127.0.0.1:<port>
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO_ID = "tiny-org/tiny-model"
SHA = "0123456789abcdef0123456789abcdef01234567"
FILES = {
    "config.json": b'{"hidden_size": 256}\n',
    "model.safetensors": bytes(range(256)) * 40,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# tiny\n",
}


class Hub:
    """What the server serves: ``files`` (repo path -> bytes) for ``repo_id``. ``mode`` ``'gated'`` or ``'missing'``
    answers every request with that error; ``'truncated'`` announces each file's length and closes the connection
    before sending any of it. ``requests`` records what was asked."""

    def __init__(self, repo_id: str = REPO_ID, files: dict[str, bytes] | None = None):
        self.repo_id = repo_id
        self.files = dict(FILES if files is None else files)
        self.mode = "ok"
        self.requests: list[str] = []
        self.endpoint = ""


def files_from_dir(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory``, keyed by its path relative to it (as a repo would list it)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
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

        def _answer(self, head):
            repo = hub.repo_id
            path = self.path.split("?")[0]
            hub.requests.append(f"{self.command} {self.path}")
            if hub.mode == "gated":
                body = {"error": "Access to this repo is restricted."}
                return self._json(body, 401, {"X-Error-Code": "GatedRepo"}, head)
            if hub.mode == "missing" or not path.startswith((f"/api/models/{repo}/", f"/{repo}/")):
                return self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"}, head)
            if re.fullmatch(rf"/api/models/{re.escape(repo)}/revision/[^/]+", path):
                siblings = [{"rfilename": name} for name in hub.files]
                return self._json({"id": repo, "sha": SHA, "siblings": siblings}, head=head)
            if path == f"/api/models/{repo}/tree/{SHA}":
                return self._json([
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in hub.files.items()
                ], head=head)
            prefix = f"/{repo}/resolve/{SHA}/"
            if path.startswith(prefix) and path[len(prefix):] in hub.files:
                data = hub.files[path[len(prefix):]]
                headers = {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
                if hub.mode == "truncated" and not head:
                    self._send(200, b"", {**headers, "Content-Length": str(len(data))}, head=True)
                    self.close_connection = True
                    return None
                return self._send(200, data, headers, head)
            return self._json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"}, head)

        def do_GET(self):
            self._answer(head=False)

        def do_HEAD(self):
            self._answer(head=True)

    return Handler


def start(hub: Hub, port: int = 0) -> ThreadingHTTPServer:
    """Serve ``hub`` on 127.0.0.1 from a daemon thread; sets ``hub.endpoint``. Stop it with ``server.shutdown()``."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(hub))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo-id", default=REPO_ID)
    parser.add_argument("--from-dir", type=Path, help="serve this directory's files (default: a few tiny files)")
    parser.add_argument("--port", type=int, default=0, help="default: any free port")
    parser.add_argument("--endpoint-file", type=Path, help="write the endpoint URL here once listening")
    args = parser.parse_args(argv)
    hub = Hub(args.repo_id, files_from_dir(args.from_dir) if args.from_dir else None)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(hub))
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    if args.endpoint_file:
        partial = args.endpoint_file.with_name(args.endpoint_file.name + ".partial")
        partial.write_text(hub.endpoint + "\n")
        partial.replace(args.endpoint_file)  # a reader never sees half a URL
    print(f"serving {args.repo_id} ({len(hub.files)} files) at {hub.endpoint}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
