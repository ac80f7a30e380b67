"""A Hugging Face Hub on loopback: the HTTP calls `huggingface_hub` makes to create a repository and a branch and to
commit a folder (metadata check, preupload, LFS batch and upload, NDJSON commit, revision info), answered as the Hub
answers them, and every file recorded as it lands. No network.

Files are kept per repository and branch as the commits left them; LFS objects by SHA-256, once, with a count of the
uploads each took. `fail_commits` refuses that many commits with a 500 after their files were uploaded: an upload
interrupted between its files and its commit.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

TOKEN = "hf_loopback_test_token"
REPO = r"(?P<repo>[^/]+/[^/]+)"


@dataclass
class Repository:
    private: bool | None
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict] = field(default_factory=list)  # {branch, summary, files: paths}

    def head(self, branch: str) -> str:
        commits = [c for c in self.commits if c["branch"] == branch]
        return hashlib.sha1(json.dumps(commits, sort_keys=True).encode()).hexdigest()


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class LoopbackHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repository] = {}
        self.lfs: dict[str, bytes] = {}
        self.lfs_uploads: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []
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
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
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
            ("GET", rf"/api/models/{REPO}/revision/(?P<branch>[^/]+)", self.revision),
        ]
        for verb, pattern, answer in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                found = {key: unquote(value) for key, value in match.groupdict().items()}
                if "repo" in found and answer != self.create_repo and found["repo"] not in self.repos:
                    return 404, {"error": "Repository not found"}
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
        self.repos[repo].commits.append({"branch": branch, "summary": header["summary"], "files": written})
        sha = self.repos[repo].head(branch)
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{sha}", "commitOid": sha}

    def revision(self, body: bytes, repo: str, branch: str) -> tuple[int, dict]:
        files = self.repos[repo].branches[branch]
        return 200, {"id": repo, "sha": self.repos[repo].head(branch), "private": bool(self.repos[repo].private),
                     "siblings": [{"rfilename": name} for name in sorted(files)]}


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
