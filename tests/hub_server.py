"""A Hugging Face Hub on loopback: the HTTP calls `huggingface_hub` makes to create a repository and a branch and to
commit a folder (metadata check, preupload, LFS batch and upload, NDJSON commit, revision info), and to download one
(revision info with the files' sizes, the tree listing, each file's metadata and bytes), answered as the Hub answers
them, and every file recorded as it lands. No network.

Files are kept per repository and branch as the commits left them, and per commit, so a revision is a branch or a
commit; LFS objects by SHA-256, once, with a count of the uploads each took. `fail_commits` refuses that many commits
with a 500 after their files were uploaded: an upload interrupted between its files and its commit. `downloads`
lists each file whose bytes were sent, as (repository, path).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

TOKEN = "hf_loopback_test_token"
REPO = r"(?P<repo>[^/]+/[^/]+)"


@dataclass
class Repository:
    private: bool | None
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    # {branch, summary, files: paths, blobs: their git SHA-1}: a commit's id follows its contents, as the Hub's does,
    # so transformers' module cache (~/.cache/huggingface/modules, by commit) never serves code another run committed
    commits: list[dict] = field(default_factory=list)
    snapshots: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> its files

    def head(self, branch: str) -> str:
        commits = [c for c in self.commits if c["branch"] == branch]
        return hashlib.sha1(json.dumps(commits, sort_keys=True).encode()).hexdigest()

    def at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of a branch or a commit; None for neither."""
        if revision in self.branches:
            return self.head(revision), self.branches[revision]
        return (revision, self.snapshots[revision]) if revision in self.snapshots else None


def point_at(server: "LoopbackHub", monkeypatch, home: Path) -> None:
    """huggingface_hub talking to `server`, with its token, its cache under `home` (HF_HOME; the endpoint's URLs and
    the cache's folder are read once as huggingface_hub is imported, so they are set there too), and files sent
    through the LFS batch API, as wherever hf_xet is not installed (Xet's storage has no loopback stand-in)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class LoopbackHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repository] = {}
        self.lfs: dict[str, bytes] = {}
        self.lfs_uploads: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
        self.downloads: list[tuple[str, str]] = []
        self.fail_commits = 0
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self, "GET")

            def do_POST(self) -> None:
                hub.handle(self, "POST")

            def do_PUT(self) -> None:
                hub.handle(self, "PUT")

            def do_HEAD(self) -> None:
                hub.handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str, branch: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo].branches[branch])

    # --- HTTP -------------------------------------------------------------------------
    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(request.path).path
        body = _read_body(request)
        with self.lock:
            self.requests.append((method, path))
            if request.headers.get("authorization") != f"Bearer {TOKEN}" and not path.startswith("/lfs-objects/"):
                status, answer = 401, {"error": "Invalid credentials in Authorization header"}
            else:
                status, answer = self.route(method, path, body)
        headers = {}
        if isinstance(answer, tuple):  # (bytes or document, headers)
            answer, headers = answer
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            request.send_header(name, value)
        request.end_headers()
        if method != "HEAD":
            request.wfile.write(data)

    def route(self, method: str, path: str, body: bytes) -> tuple[int, dict | bytes]:
        routes = [
            ("POST", r"/api/repos/create", self.create_repo),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("POST", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", self.create_branch),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<branch>[^/]+)", self.preupload),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", self.lfs_batch),
            ("PUT", r"/lfs-objects/(?P<oid>[0-9a-f]{64})", self.lfs_put),
            ("POST", rf"/api/models/{REPO}/commit/(?P<branch>[^/]+)", self.commit),
            ("GET", rf"/api/models/{REPO}", self.revision),  # the default branch's
            ("GET", rf"/api/models/{REPO}/revision/(?P<revision>[^/]+)", self.revision),
            ("GET", rf"/api/models/{REPO}/tree/(?P<revision>[^/]+)", self.tree),
            ("GET", rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<file>.+)", self.download),
            ("HEAD", rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<file>.+)", self.resolve),
        ]
        for verb, pattern, answer in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                found = {key: unquote(value) for key, value in match.groupdict().items()}
                if "repo" in found and answer != self.create_repo and found["repo"] not in self.repos:
                    return 404, ({"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                if "revision" in found and self.repos[found["repo"]].at(found["revision"]) is None:
                    return 404, ({"error": f"Invalid rev id: {found['revision']}"},
                                 {"X-Error-Code": "RevisionNotFound"})
                return answer(body, **found)
        return 404, {"error": f"no route for {method} {path}"}

    def create_repo(self, body: bytes) -> tuple[int, dict]:
        payload = json.loads(body)
        repo = f"{payload['organization']}/{payload['name']}"
        if repo in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}
        self.repos[repo] = Repository(private={"private": True, "public": False}.get(payload.get("visibility")))
        return 200, {"url": f"{self.url}/{repo}"}

    def validate_yaml(self, body: bytes) -> tuple[int, dict]:
        content = json.loads(body)["content"]
        match = re.match(r"---\n(.*?)\n---\n", content, re.S)
        try:
            metadata = yaml.safe_load(match.group(1)) if match else None
        except yaml.YAMLError as err:
            return 400, {"errors": [{"message": f"invalid YAML: {err}"}], "warnings": []}
        if not isinstance(metadata, dict):
            return 400, {"errors": [{"message": "metadata must be a mapping"}], "warnings": []}
        return 200, {"errors": [], "warnings": []}

    def create_branch(self, body: bytes, repo: str, branch: str) -> tuple[int, dict]:
        branches = self.repos[repo].branches
        if branch in branches:
            return 409, {"error": "Reference already exists"}
        start = (json.loads(body) if body else {}).get("startingPoint") or "main"
        branches[branch] = dict(branches[start])
        return 200, {}

    def preupload(self, body: bytes, repo: str, branch: str) -> tuple[int, dict]:
        files = self.repos[repo].branches.get(branch, {})
        answers = []
        for entry in json.loads(body)["files"]:
            lfs = entry["path"].endswith(".safetensors")
            held = files.get(entry["path"])
            oid = None if held is None else hashlib.sha256(held).hexdigest() if lfs else git_blob_sha1(held)
            answers.append({"path": entry["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
        return 200, {"files": answers}

    def lfs_batch(self, body: bytes, repo: str) -> tuple[int, dict]:
        objects = []
        for item in json.loads(body)["objects"]:
            answer = {"oid": item["oid"], "size": item["size"]}
            if item["oid"] not in self.lfs:  # what the Hub already holds is not asked for again
                answer["actions"] = {"upload": {"href": f"{self.url}/lfs-objects/{item['oid']}"}}
            objects.append(answer)
        return 200, {"transfer": "basic", "objects": objects}

    def lfs_put(self, body: bytes, oid: str) -> tuple[int, dict]:
        if hashlib.sha256(body).hexdigest() != oid:
            return 400, {"error": "content does not match its oid"}
        self.lfs[oid] = body
        self.lfs_uploads[oid] = self.lfs_uploads.get(oid, 0) + 1
        return 200, {}

    def commit(self, body: bytes, repo: str, branch: str) -> tuple[int, dict]:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        if self.fail_commits:
            self.fail_commits -= 1
            return 500, {"error": "Internal Error - the commit was interrupted"}
        files = self.repos[repo].branches.setdefault(branch, {})
        written = []
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return 400, {"error": f"LFS object {value['oid']} was never uploaded"}
                files[value["path"]] = self.lfs[value["oid"]]
            else:
                continue
            written.append(value["path"])
        self.repos[repo].commits.append({"branch": branch, "summary": header["summary"], "files": written,
                                         "blobs": [git_blob_sha1(files[path]) for path in written]})
        sha = self.repos[repo].head(branch)
        self.repos[repo].snapshots[sha] = dict(files)
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{sha}", "commitOid": sha}

    def revision(self, body: bytes, repo: str, revision: str = "main") -> tuple[int, dict]:
        sha, files = self.repos[repo].at(revision)
        # Its LFS entries name the SHA-256 `sha256`, where a tree names it `oid`.
        siblings = [{"rfilename": name, "size": blob["size"], "blobId": blob["oid"],
                     **({"lfs": {**blob["lfs"], "sha256": blob["lfs"]["oid"]}} if "lfs" in blob else {})}
                    for name, blob in ((name, _blob(name, content)) for name, content in sorted(files.items()))]
        return 200, {"id": repo, "sha": sha, "private": bool(self.repos[repo].private), "siblings": siblings}

    def tree(self, body: bytes, repo: str, revision: str) -> tuple[int, list]:
        files = self.repos[repo].at(revision)[1]
        return 200, [{"type": "file", "path": name, **_blob(name, content)} for name, content in sorted(files.items())]

    def resolve(self, body: bytes, repo: str, revision: str, file: str) -> tuple[int, tuple]:
        """A file's metadata (what HEAD answers): the commit, and its ETag (the LFS SHA-256, else the git blob)."""
        sha, files = self.repos[repo].at(revision)
        if file not in files:
            return 404, ({"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
        blob = _blob(file, files[file])
        etag = blob["lfs"]["oid"] if "lfs" in blob else blob["oid"]
        return 200, (files[file], {"X-Repo-Commit": sha, "ETag": f'"{etag}"'})

    def download(self, body: bytes, repo: str, revision: str, file: str) -> tuple[int, tuple]:
        status, answer = self.resolve(body, repo, revision, file)
        if status == 200:
            self.downloads.append((repo, file))
        return status, answer


def _blob(name: str, content: bytes) -> dict:
    """A file as the Hub's tree lists it: its size and git blob id, and for the weights (LFS, as preupload says)
    their SHA-256."""
    blob = {"size": len(content), "oid": git_blob_sha1(content)}
    if name.endswith(".safetensors"):
        blob["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
    return blob


def _read_body(request: BaseHTTPRequestHandler) -> bytes:
    if request.headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(request.rfile.readline().split(b";")[0], 16)
            chunk = request.rfile.read(size)
            request.rfile.readline()
            if size == 0:
                return b"".join(chunks)
            chunks.append(chunk)
    return request.rfile.read(int(request.headers.get("content-length") or 0))
