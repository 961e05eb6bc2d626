"""Fresh child processes without the interpreter's start-up each time (the hostile harness's
children): a server process imports the heavy modules once (jax, orbax, jax_ucp: seconds on a
loaded host, before any line of the child's own runs), then forks one child per request. A child starts as a fresh interpreter
would be after those imports and nothing else: no JAX backend made (XLA_FLAGS and the device
count are read when the child first asks for a device), its own session, working directory,
environment, argv, stdout and stderr, ``random`` / ``numpy.random`` reseeded and the temporary
folder looked up again. What a fresh interpreter would read at import time from the
environment (``JAX_PLATFORMS``, ``PYTHONHASHSEED``) is the server's: a caller whose child sets
such a variable itself runs it in a fresh interpreter instead (``subprocess``).

The protocol: one Unix socket to the server; a request is a JSON line (argv as after
``python``, cwd, env) sent with the child's stdout and stderr descriptors; the server answers
the child's pid, then its exit status once it ends (one child at a time per server).

``python3 -m tests.zygote MODULE...`` is the server (``Zygote`` starts it)."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from tests.ucp_testing import REPO

_SERVERS: dict[tuple, Zygote] = {}


class Child:
    """A forked child: ``pid`` (a session leader: ``os.killpg(pid, ...)`` ends its group),
    ``stdout`` (the read end of its stdout when piped), ``poll`` / ``wait`` as ``Popen``'s."""

    def __init__(self, zygote: Zygote, pid: int, stdout):
        self.zygote, self.pid, self.stdout = zygote, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("a zygote child", timeout or 0.0)
            self.returncode = self.zygote.status(left)
        return self.returncode


class Zygote:
    """The server for ``preload`` under ``env`` (the environment the imports see)."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]):
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(theirs.fileno()), *preload],
            cwd=REPO,
            env=env,
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.buf = b""
        self.running = False  # a child under way (its status not read yet)
        assert self._line(600.0) == {"ready": True}, "the zygote did not start"

    def _line(self, timeout: float | None) -> dict | None:
        """The server's next message, or None when ``timeout`` seconds pass without one."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self.sock], [], [], left)[0]:
                return None
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"the zygote ended (exit {self.proc.wait()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def spawn(self, argv: list[str], *, cwd: str, env: dict[str, str], stdout: int, stderr: int):
        """The pid of a child running ``python *argv`` with these descriptors as its 1 and 2."""
        if self.running:  # one left behind (its caller failed): ended before the next
            self.status(None)
        request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode() + b"\n"
        socket.send_fds(self.sock, [request], [stdout, stderr])
        message = self._line(None)
        assert message is not None
        self.running = True
        return message["pid"]

    def status(self, timeout: float | None) -> int | None:
        """The exit status of the child under way once it ended (waiting up to ``timeout``
        seconds, None: for ever), else None."""
        message = self._line(timeout)
        if message is None:
            return None
        self.running = False
        return message["rc"]

    def close(self) -> None:
        self.sock.close()  # the server ends when it reads the end (after its child, if any)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def server(preload: tuple[str, ...], env: dict[str, str]) -> Zygote:
    """This process's server for ``preload`` under ``env`` (started once, ended at exit)."""
    key = (preload, tuple(sorted(env.items())))
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        _SERVERS[key] = Zygote(preload, env)
        atexit.register(_SERVERS[key].close)
    return _SERVERS[key]


def popen(zygote: Zygote, argv: list[str], *, cwd: str, env: dict[str, str], stderr: int) -> Child:
    """``subprocess.Popen([python, *argv], stdout=PIPE, start_new_session=True)``, forked."""
    r, w = os.pipe()
    try:
        pid = zygote.spawn(argv, cwd=cwd, env=env, stdout=w, stderr=stderr)
    finally:
        os.close(w)
    return Child(zygote, pid, os.fdopen(r, "rb", buffering=0))


def run(zygote: Zygote, argv: list[str], *, cwd: str, env: dict[str, str], timeout: float):
    """``subprocess.run([python, *argv], capture_output=True, text=True, timeout=...)``,
    forked: (returncode, stdout, stderr)."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = zygote.spawn(argv, cwd=cwd, env=env, stdout=out.fileno(), stderr=err.fileno())
        child = Child(zygote, pid, None)
        try:
            rc = child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace")


# ---- the server


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become what ``python *argv`` would be, run it, exit."""
    import random
    import runpy
    import tempfile

    os.setsid()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in (*fds, null):
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # looked up again under the child's TMPDIR
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    for name in argv[1:]:
        importlib.import_module(name)
    if "jax" in sys.modules:  # a backend made here would be every child's, its flags these
        from jax._src import xla_bridge

        assert not xla_bridge._backends, f"importing {argv[1:]} made a JAX backend"
    sock.sendall(b'{"ready": true}\n')
    buf = b""
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not msg:
            return
        buf += msg
        if not buf.endswith(b"\n"):
            for fd in fds:
                os.close(fd)
            raise RuntimeError("a request in pieces")  # requests are small: never split
        request, buf = json.loads(buf), b""
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(request, fds)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        sock.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    main(sys.argv[1:])
