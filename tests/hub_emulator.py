"""A loopback HTTP server speaking the part of the Hugging Face hub API that `snapshot_download` uses.

Routes (as huggingface_hub 2.x calls them):
  GET  /api/models/{org}/{name}/revision/{rev}     repo info; its `sha` is the commit
  GET  /api/models/{org}/{name}/tree/{rev}          the file listing (recursive)
  HEAD /{org}/{name}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length
  GET  /{org}/{name}/resolve/{rev}/{file}           the bytes
Unknown repositories and revisions answer 404 with the hub's `X-Error-Code`, so the client raises
the same errors as against the real hub. Every request is recorded (method, path, Authorization).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from dataclasses import dataclass, field
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HubRepo:
    """One model repository at one commit: repo path -> local file."""

    files: dict[str, Path]
    commit: str = ""
    branch: str = "main"

    def __post_init__(self) -> None:
        if not self.commit:
            digest = hashlib.sha1(usedforsecurity=False)
            for name in sorted(self.files):
                digest.update(name.encode() + self.files[name].read_bytes()[:4096])
            self.commit = digest.hexdigest()


@dataclass
class HubEmulator:
    repos: dict[str, HubRepo]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubEmulator:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def file_downloads(self) -> list[str]:
        return [path for method, path, _ in self.requests if method == "GET" and "/resolve/" in path]


def repo_from_dir(directory: Path, skip: tuple[str, ...] = ()) -> HubRepo:
    return HubRepo({p.name: p for p in sorted(directory.iterdir()) if p.is_file() and p.name not in skip})


@cache
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class _HubHandler(BaseHTTPRequestHandler):
    """The hub's routes; `hub` is set per emulator by `_handler`."""

    hub: HubEmulator
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path, self.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, rev = "/".join(parts[2:4]), parts[5]
            if (repo := self._repo(repo_id, rev)) is not None:
                self._json(repo_id, repo, listing=parts[4] == "tree")
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if (repo := self._repo(repo_id, rev)) is not None:
                self._file(repo, name, body)
        else:
            self._error(404, "EntryNotFound", "no such route")

    def _repo(self, repo_id: str, rev: str) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
        elif rev not in (repo.branch, repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        else:
            return repo
        return None

    def _json(self, repo_id: str, repo: HubRepo, listing: bool) -> None:
        if listing:
            data = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": _sha256(p)[:40]}
                for name, p in repo.files.items()
            ]
        else:
            data = {"id": repo_id, "sha": repo.commit, "siblings": [{"rfilename": n} for n in repo.files]}
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _file(self, repo: HubRepo, name: str, body: bool) -> None:
        local = repo.files.get(name)
        if local is None:
            self._error(404, "EntryNotFound", f"{name} not found")
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{_sha256(local)}"')
        self.send_header("Content-Length", str(local.stat().st_size))
        self.end_headers()
        if body:
            with open(local, "rb") as f:
                shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _error(self, status: int, code: str, message: str) -> None:
        raw = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def _handler(hub: HubEmulator) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_HubHandler,), {"hub": hub})
