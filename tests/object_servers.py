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
