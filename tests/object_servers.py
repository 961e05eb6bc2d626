"""The local object-store servers tests talk to: moto's S3 server (``moto_server``) and
``gcp-storage-emulator``, each started once per test process on 127.0.0.1 and stopped at its
end. Once per process because TensorStore's GCS driver reads ``STORAGE_EMULATOR_HOST`` once:
a second emulator on another port would never be reached. Registered in tests/conftest.py."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

from tests.ucp_testing import free_port


def _wait_for(port: int, proc: subprocess.Popen, what: str) -> None:
    """Until the server listens or exits: a start slowed by a loaded host is no failure (the
    test's timeout guards a server that neither listens nor exits)."""
    while True:
        if proc.poll() is not None:
            proc.stdout.seek(0)
            raise RuntimeError(f"{what} exited: {proc.stdout.read()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def _server(cmd: list[str], port: int, what: str):
    exe = shutil.which(cmd[0])
    if exe is None:
        pytest.fail(f"{cmd[0]} is not installed (pip install -e '.[test]')")
    # The servers log every request: into a file, since a pipe nobody reads fills up (64 KiB)
    # and then blocks the server in the middle of a request.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([exe, *cmd[1:]], stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.stdout = log
    _wait_for(port, proc, what)
    return proc


@pytest.fixture(scope="session")
def s3_server():
    port = free_port()
    proc = _server(["moto_server", "-H", "127.0.0.1", "-p", str(port)], port, "moto_server")
    endpoint = f"http://127.0.0.1:{port}"
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/ucp-test", method="PUT"))
    yield (
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        },
        "s3://ucp-test",
    )
    proc.terminate()
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.fixture(scope="session")
def gcs_server():
    port = free_port()
    cmd = ["gcp-storage-emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"]
    proc = _server(cmd, port, "gcp-storage-emulator")
    endpoint = f"http://127.0.0.1:{port}"
    body = json.dumps({"name": "ucp-test"}).encode()
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=test",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(request)
    yield {"STORAGE_EMULATOR_HOST": endpoint}, "gs://ucp-test"
    proc.terminate()
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.fixture(params=["s3", "gs"])
def bucket(request, monkeypatch):
    """(environment, bucket URL) of a live local server of each kind (moto's S3, the GCS
    emulator), its credentials set."""
    env, url = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env, url


@pytest.fixture
def bucket_url(bucket):
    """The URL of ``bucket``."""
    return bucket[1]


class HubServer:
    """A local server with the Hugging Face Hub's layout (``hub_server``): ``/api/models/REPO/
    revision/REV`` (the model info: ``sha``, ``siblings``), ``/REPO/resolve/REV/PATH`` (a
    ``.safetensors`` file redirected to the CDN, another server on another port, as the Hub
    does; other files served there), ``Range`` on both; the token required on the Hub's own
    host. ``log``: every request (server, method, file, range). Synthetic: no network."""

    TOKEN = "synthetic-token"

    def __init__(self):
        import http.server
        import threading

        self.repos: dict[str, dict] = {}
        self.log: list[dict] = []
        self.redirect_to: str | None = None  # the CDN hop's target instead of the CDN
        self.trickle_s: float | None = None  # the listing sent a byte per this many seconds
        self._after_listing: dict[str, dict] = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                outer.answer(self, self.server is outer.cdn)

            do_GET = do_HEAD

        self.hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.cdn = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        for s in (self.hub, self.cdn):
            # a short poll: shutdown() waits for it (0.5 s each by default, per test)
            threading.Thread(target=s.serve_forever, args=(0.02,), daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes]) -> str:
        """A commit of ``files`` to ``repo``'s ``main``: its sha."""
        import hashlib

        entry = self.repos.setdefault(repo, {"refs": {}, "commits": {}})
        sha = hashlib.sha1(repr((repo, len(entry["commits"]), sorted(files))).encode()).hexdigest()
        entry["commits"][sha], entry["refs"]["main"] = dict(files), sha
        return sha

    def file_commit(self, repo: str) -> dict[str, bytes]:
        """The files of ``repo``'s ``main``."""
        entry = self.repos[repo]
        return entry["commits"][entry["refs"]["main"]]

    def push_after_each_listing(self, repo: str, shas: list[str]) -> None:
        """After every listing of ``repo``, its ``main`` moved to the next of ``shas`` (a push
        mid-read, again and again)."""
        self._after_listing[repo] = {"shas": shas, "next": 0}

    def close(self) -> None:
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    def answer(self, h, cdn: bool) -> None:
        import urllib.parse

        path = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path).lstrip("/")
        auth = h.headers.get("Authorization")
        if not cdn and auth != f"Bearer {self.TOKEN}":
            return self._send(h, 401, b"", {"X-Error-Message": "Invalid credentials"})
        if cdn:  # /SHA/PATH
            sha, _, name = path.partition("/")
            commits = [e["commits"][sha] for e in self.repos.values() if sha in e["commits"]]
            return self._file(h, commits[0] if commits else {}, name, "cdn", auth)
        if path.startswith("api/models/"):
            repo, _, rev = path[len("api/models/") :].partition("/revision/")
            entry, sha = self._commit(repo, rev)
            if sha is None:
                code = "RevisionNotFound" if entry["commits"] else "RepoNotFound"
                return self._send(h, 404, b"", {"X-Error-Code": code})
            siblings = [{"rfilename": n} for n in sorted(entry["commits"][sha])]
            body = json.dumps({"id": repo, "sha": sha, "siblings": siblings}).encode()
            push = self._after_listing.get(repo)
            if push is not None:
                entry["refs"]["main"] = push["shas"][push["next"] % len(push["shas"])]
                push["next"] += 1
            headers = {"Content-Type": "application/json"}
            return self._send(h, 200, body, headers, trickle_s=self.trickle_s)
        org, name, resolve, rest = (path.split("/", 3) + ["", "", "", ""])[:4]
        rev, _, file = rest.partition("/")
        entry, sha = self._commit(f"{org}/{name}", rev)
        if resolve != "resolve" or sha is None:
            return self._send(h, 404, b"", {"X-Error-Code": "RepoNotFound"})
        if file.endswith(".safetensors") and file in entry["commits"][sha]:
            hop = self.redirect_to or f"{self.cdn_url}/{sha}/{file}?X-Amz-Signature=synthetic"
            self.log.append({"server": "hub", "method": h.command, "path": file, "range": None})
            return self._send(h, 302, b"", {"Location": hop})
        return self._file(h, entry["commits"][sha], file, "hub", auth)

    def _commit(self, repo: str, rev: str) -> tuple[dict, str | None]:
        """(the repo's entry, {} when there is none; the commit ``rev`` names, or None)."""
        entry = self.repos.get(repo, {"refs": {}, "commits": {}})
        sha = entry["refs"].get(rev, rev)
        return entry, sha if sha in entry["commits"] else None

    def _file(self, h, files: dict, name: str, server: str, auth) -> None:
        import re

        if name not in files:
            return self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound"})
        data, asked = files[name], h.headers.get("Range")
        record = {"server": server, "method": h.command, "path": name, "range": asked}
        # this request's own record: with requests served on several threads, log[-1] may be
        # another's by the time the range is parsed
        record = {**record, "authorization": auth, "start": None, "stop": None}
        self.log.append(record)
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", asked or "")
        if asked is None or m is None or not (m[1] or m[2]):
            return self._send(h, 200, data, {})
        if not m[1]:  # a suffix: the last N bytes
            m = ["", str(max(0, len(data) - int(m[2]))), ""]
        start, stop = int(m[1]), min(int(m[2]) + 1 if m[2] else len(data), len(data))
        record.update(start=start, stop=int(m[2]) + 1 if m[2] else len(data))
        if start >= len(data):
            return self._send(h, 416, b"", {"Content-Range": f"bytes */{len(data)}"})
        content_range = f"bytes {start}-{stop - 1}/{len(data)}"
        return self._send(h, 206, data[start:stop], {"Content-Range": content_range})

    @staticmethod
    def _send(h, status: int, body: bytes, headers: dict, trickle_s: float | None = None) -> None:
        """The answer; ``trickle_s``: its body a byte at a time, that many seconds apart (a
        server holding a reader without ever meeting a per-read timeout)."""
        import time

        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            h.send_header(k, v)
        h.end_headers()
        if h.command == "HEAD":
            return
        if trickle_s is None:
            h.wfile.write(body)
            return
        try:
            for i in range(len(body)):
                h.wfile.write(body[i : i + 1])
                h.wfile.flush()
                time.sleep(trickle_s)
        except OSError:  # the reader gave up
            pass


@pytest.fixture
def hub_server(monkeypatch):
    """A ``HubServer`` on 127.0.0.1, ``HF_ENDPOINT`` and ``HF_TOKEN`` pointing at it."""
    server = HubServer()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_TOKEN", HubServer.TOKEN)
    yield server
    server.close()
