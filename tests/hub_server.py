"""A stand-in for the Hugging Face hub on loopback, for the real `huggingface_hub` client (HF_ENDPOINT):
no hub is reachable here, so `tunehouse models add` is tested against this instead of a mock of our code.

It serves model repos from local folders over the hub's HTTP API, as `snapshot_download` reads it: the
revision info (`GET /api/models/{repo}/revision/{rev}`: the commit sha), the file tree
(`GET /api/models/{repo}/tree/{rev}`) and each file (`HEAD`/`GET /{repo}/resolve/{rev}/{path}` with
`X-Repo-Commit`, `ETag` and `X-Linked-Etag`/`X-Linked-Size` for LFS files, as the hub answers). A gated
repo answers 401 with `X-Error-Code: GatedRepo` without the right bearer token. `requests` counts the
file downloads per path, so a test can tell how often each file was fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    folder: Path
    commit: str
    token: str | None = None  # gated: only this bearer token may read it

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.rglob("*") if p.is_file())


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    downloads: Counter[str] = field(default_factory=Counter)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add(self, repo_id: str, folder: Path, *, token: str | None = None) -> str:
        """Serve `folder` as `repo_id`; returns its commit sha (from its files, as git's would change)."""
        digest = hashlib.sha1()
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
        self.repos[repo_id] = Repo(folder, digest.hexdigest(), token)
        return self.repos[repo_id].commit

    def start(self) -> Hub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # --- the hub's answers --------------------------------------------------------------------------

    def _find(self, parts: list[str]) -> tuple[str, Repo, list[str]] | None:
        for n in (2, 1):
            repo_id = "/".join(parts[:n])
            if repo_id in self.repos:
                return repo_id, self.repos[repo_id], parts[n:]
        return None

    def _answer(self, req: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(req.path).path).strip("/").split("/")
        api = path[:2] == ["api", "models"]
        found = self._find(path[2:] if api else path)
        if found is None:
            return _send(req, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        repo_id, repo, rest = found
        if repo.token is not None and req.headers.get("Authorization") != f"Bearer {repo.token}":
            headers = {"X-Error-Code": "GatedRepo"}
            return _send(req, 401, b'{"error": "Access to this model is restricted"}', headers)
        if api and not rest:  # the model's info at its main branch
            rest = ["revision", "main"]
        if len(rest) < 2 or rest[1] not in (repo.commit, "main"):
            headers = {"X-Error-Code": "RevisionNotFound"}
            return _send(req, 404, b'{"error": "Invalid rev id"}', headers)
        files = repo.files()
        if api and rest[0] == "revision":
            siblings = [{"rfilename": p.relative_to(repo.folder).as_posix()} for p in files]
            info = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings}
            return _send(req, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if api and rest[0] == "tree":
            tree = [_tree_entry(p, repo.folder) for p in files]
            return _send(req, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
        if not api and rest[0] == "resolve":
            target = repo.folder.joinpath(*rest[2:])
            if not target.is_file():
                return _send(req, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})
            data = target.read_bytes()
            entry = _tree_entry(target, repo.folder)
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{entry["oid"]}"'}
            if "lfs" in entry:
                headers |= {"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(len(data))}
            if body:
                self.downloads[f"{repo_id}/{'/'.join(rest[2:])}"] += 1
            return _send(req, 200, data if body else b"", headers, length=len(data))
        return _send(req, 404, b'{"error": "not served by this stand-in"}', {})


def _tree_entry(path: Path, root: Path) -> dict[str, object]:
    data = path.read_bytes()
    entry: dict[str, object] = {
        "type": "file",
        "path": path.relative_to(root).as_posix(),
        "size": len(data),
        "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
    }
    if path.suffix == ".safetensors":  # weights are LFS files on the hub: their oid is the sha256
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _send(
    req: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], length: int | None = None
) -> None:
    req.send_response(status)
    for name, value in headers.items():
        req.send_header(name, value)
    req.send_header("Content-Length", str(len(data) if length is None else length))
    req.end_headers()
    if req.command != "HEAD":
        req.wfile.write(data)
