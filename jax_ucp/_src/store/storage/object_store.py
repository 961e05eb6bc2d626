"""A checkpoint under a prefix in an object store (``s3://``, ``gs://``).

``s3://bucket/path`` and ``gs://bucket/path`` are reached through TensorStore's own kvstore
drivers (``s3``, ``gcs``), for the arrays and for the few small files around them (``ucp.json``,
per-process digests), so one code path reads and writes both. Credentials and endpoints come
from the usual environment, read by TensorStore itself (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, profiles; ``GOOGLE_APPLICATION_CREDENTIALS``);
the endpoint and region from ``AWS_ENDPOINT_URL[_S3]`` / ``AWS_REGION`` (``AWS_DEFAULT_REGION``)
and the GCS endpoint from ``STORAGE_EMULATOR_HOST`` are put in the spec here, since TensorStore
does not read those. ``set_object_store_options`` overrides them per scheme.

An object store has no rename, so a checkpoint there is committed by writing ``ucp.json`` last:
a prefix without it is not a checkpoint (``docs/FORMAT.md``, "Object stores"). Two saves of one
prefix are kept apart by a lock object in it. The only module that writes objects itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import RequestError, SaveConflictError
from jax_ucp._src.multihost import liveness
from jax_ucp._src.store.storage import base
from jax_ucp._src.store.storage.base import SCHEMES, Claim, Storage, Transaction, kvstore_join

log = logging.getLogger(__name__)

_options: dict[str, dict[str, Any]] = {}


def set_object_store_options(scheme: str, **options: Any) -> None:
    """Explicit TensorStore kvstore options for every ``scheme://`` URL this process opens, for
    endpoints and credentials the environment does not give, e.g. ``set_object_store_options(
    "s3", endpoint="http://127.0.0.1:9000", aws_region="us-east-1")`` (members of TensorStore's
    ``s3`` / ``gcs`` kvstore spec). They override the environment. Per process: every process of
    a multi-process save or restore sets the same. ``None`` removes one."""
    if scheme not in SCHEMES:
        raise RequestError(f"unknown scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
    for k in sorted(options.keys() & {"driver", "bucket", "path"}):
        raise RequestError(
            f"set_object_store_options({scheme!r}): {k!r} comes from each URL, not an option"
        )
    merged = {**_options.get(scheme, {}), **options}
    _options[scheme] = {k: v for k, v in merged.items() if v is not None}


def kvstore_root(url: str) -> dict:
    """The TensorStore kvstore spec of the prefix ``url`` (its path ends with "/")."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES:
        raise RequestError(f"{url}: not an object-store URL (expected s3:// or gs://)")
    bucket, _, path = rest.partition("/")
    path = path.rstrip("/")
    if not bucket or not path:
        raise RequestError(
            f"{url}: expected {scheme}://BUCKET/PATH (a checkpoint is a prefix, never a bucket root)"
        )
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise RequestError(f"{url}: empty, '.' or '..' path components are not allowed")
    spec: dict[str, Any] = {"driver": SCHEMES[scheme], "bucket": bucket, "path": path + "/"}
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
        credentials = _aws_credentials()
        if credentials is not None:
            spec["aws_credentials"] = credentials
    elif os.environ.get("STORAGE_EMULATOR_HOST"):
        host = os.environ["STORAGE_EMULATOR_HOST"]
        spec.setdefault("context", {})["gcs_request_retries"] = {"max_retries": 2}
        if "TENSORSTORE_GCS_HTTP_URL" not in os.environ:  # an emulator takes no credentials
            os.environ["TENSORSTORE_GCS_HTTP_URL"] = host if "://" in host else f"http://{host}"
            os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # no E1126 line
    spec.update(_options.get(scheme, {}))
    return spec


def _aws_credentials() -> dict | None:
    """The AWS SDK's default chain reads ``~/.aws/config`` and ``~/.aws/credentials`` first and
    prints an error line to stderr for each one missing (``E1126 ... Failed to open file
    '/root/.aws/config'``) on every s3 open. With keys in the environment and no AWS files to
    read, the environment is named as the source; otherwise (a profile, files, web identity,
    an instance role) the default chain decides, as before."""
    env = os.environ
    if not (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")):
        return None
    home = os.path.expanduser("~")
    files = [
        env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
        env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
    ]
    if env.get("AWS_PROFILE") or any(os.path.exists(f) for f in files):
        return None
    return {"type": "environment"}


def join(root: str, *parts: str) -> str:
    """The URL ``root`` joined with ``parts`` ("/")."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts if p)])


def _kvstore(root: str | Mapping) -> ts.KvStore:
    spec = kvstore_root(root) if isinstance(root, str) else dict(root)
    return ts.KvStore.open(spec).result()


def read(root: str, name: str, limit: int) -> bytes | None:
    """Object ``name`` under the prefix ``root``, or None when it does not exist. At most
    ``limit`` bytes are fetched; a larger object is an error, never read whole.

    Args:
        root: the object-store prefix (``s3://bucket/ckpt``, ``gs://...``)
        name: the object's name under it
        limit: the most bytes accepted
    """
    stamped = read_stamped(root, name, limit)
    return None if stamped is None else stamped[0]


def read_stamped(root: str, name: str, limit: int) -> tuple[bytes, bytes] | None:
    """``read``, with the object's storage generation (for a conditional write or delete of
    exactly that version).

    Args:
        root: the object-store prefix (``s3://bucket/ckpt``, ``gs://...``)
        name: the object's name under it
        limit: the most bytes accepted
    """
    kv = _kvstore(root)
    try:  # a byte past the limit: present means too large
        beyond = kv.read(name, byte_range=slice(limit, limit + 1)).result()
    except ValueError:
        pass  # past the end (OUT_OF_RANGE; some emulators answer 206 with an odd range): small
    else:
        if beyond.state != "value":
            return None
        raise RequestError(f"{join(root, name)}: more than the {limit} bytes it may have")
    result = kv.read(name).result()
    return (bytes(result.value), result.stamp.generation) if result.state == "value" else None


def exists(root: str, name: str) -> bool:
    """Whether object ``name`` exists under ``root`` (a zero-byte ranged read)."""
    return _kvstore(root).read(name, byte_range=slice(0, 0)).result().state == "value"


def write(root: str, name: str, data: bytes) -> None:
    """One object, whole (an object store's single PUT: readers see all of it or none).

    Args:
        root: the object-store prefix (``s3://bucket/ckpt``, ``gs://...``)
        name: the object's name under it
        data: its whole content
    """
    _kvstore(root).write(name, data).result()


def create(root: str, name: str, data: bytes) -> bool:
    """Writes object ``name`` only if there is none: True if this call created it.

    A conditional PUT (TensorStore sends ``If-None-Match: *`` to S3, ``ifGenerationMatch=0`` to
    GCS), so of several callers at once exactly one gets True where the server honours the
    condition (S3 and GCS do, and moto; gcp-storage-emulator ignores it).

    Args:
        root: the object-store prefix (``s3://bucket/ckpt``, ``gs://...``)
        name: the object's name under it
        data: its whole content
    """
    kv = _kvstore(root)
    current = kv.read(name, byte_range=slice(0, 0)).result()
    if current.state == "value":
        return False
    # A failed condition is no error in TensorStore: the returned generation is empty.
    return kv.write(name, data, if_equal=current.stamp.generation).result().generation != b""


def list_names(root: str, prefix: str = "") -> list[str]:
    """Every object name under ``root`` (relative to it) starting with ``prefix``.

    Listed from the bucket root with the full prefix and filtered here: a server that ignores
    a list's range (gcp-storage-emulator does) must not make other objects look like ours."""
    spec = kvstore_root(root)
    full = spec["path"] + prefix
    bucket = _kvstore({**spec, "path": ""})
    keys = bucket.list(ts.KvStore.KeyRange(full, _successor(full))).result()
    return sorted(k.decode()[len(spec["path"]) :] for k in keys if k.decode().startswith(full))


def delete(root: str, name: str, *, if_equal: bytes | None = None) -> bool:
    """One object (a single DELETE; deleting a missing one is not an error). With ``if_equal``
    (a generation from ``read_stamped``) only that version: False if the object changed.

    Args:
        root: the object-store prefix (``s3://bucket/ckpt``, ``gs://...``)
        name: the object's name under it
        if_equal: the generation to delete (None: whatever is there)
    """
    result = _kvstore(root).write(name, None, if_equal=if_equal).result()
    return if_equal is None or result.generation != b""


def delete_names(root: str, names: list[str]) -> None:
    """The objects ``names`` under the prefix ``root``, one DELETE each, all in flight at once:
    never a range delete, which a server ignoring list ranges would apply to other prefixes.
    The caller decides which names are its own (``writer.commit`` deletes only a killed save's
    arrays and digest reports)."""
    kv = _kvstore(root)
    for f in [kv.write(name, None) for name in names]:
        f.result()


def _successor(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix``."""
    data = bytearray(prefix.encode())
    while data and data[-1] == 0xFF:
        data.pop()
    if not data:
        return ""
    data[-1] += 1
    return data.decode(errors="surrogateescape")


LOCK_OBJECT = ".ucp-lock"  # inside the prefix: a role scoped to it can write it
_held_locks: set[str] = set()  # tokens of the object-store locks this process holds


@contextlib.contextmanager
def object_store_lock(url: str):
    """``save_lock`` for a prefix ``s3://`` / ``gs://``: the object ``<url>/.ucp-lock``, created
    only if absent (a conditional PUT), so of two saves to one prefix exactly one proceeds; the
    other gets ``SaveConflictError`` at once, having written and deleted nothing. The holder
    deletes it at the end. A lock left by a killed save is taken over by the next save on the
    same host once that process is gone; from another host the error names the object to
    delete (no heartbeat tells a slow save from a dead one)."""
    token = uuid.uuid4().hex
    me = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": token}
    where = join(url, LOCK_OBJECT)
    for _ in range(3):
        if create(url, LOCK_OBJECT, json.dumps(me).encode()):
            # read back: a server whose conditional PUT is not atomic (moto's threaded one)
            # lets two creators succeed; the one whose token is not there backs off
            back = read_stamped(url, LOCK_OBJECT, 1 << 16)
            if back is not None and (_lock_owner(back[0]) or {}).get("token") == token:
                break
            raise SaveConflictError(
                f"{url}: another save took the lock object {where} at the same moment; "
                f"nothing was written."
            )
        held = read_stamped(url, LOCK_OBJECT, 1 << 16)
        if held is None:
            continue  # released meanwhile
        owner = _lock_owner(held[0])
        if _lock_is_stale(owner, me):
            log.warning("taking over %s: its process %s is gone", where, (owner or {}).get("pid"))
            delete(url, LOCK_OBJECT, if_equal=held[1])  # of two takers, one wins
            continue
        who = (
            f"host {owner['host']}, process {owner['pid']}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(owner['time']))}"
            if owner
            else "an unreadable lock"
        )
        raise SaveConflictError(
            f"{url}: another save to this prefix is in progress ({who}: lock object {where}); "
            f"nothing was written. If that save was killed, delete {where} and save again."
        )
    else:
        raise SaveConflictError(f"{url}: could not take the lock {where}; nothing was written.")
    _held_locks.add(token)
    failed = True
    try:
        yield
        failed = False
    finally:
        _held_locks.discard(token)
        try:
            held = read_stamped(url, LOCK_OBJECT, 1 << 16)
            if held is not None and (_lock_owner(held[0]) or {}).get("token") == token:
                delete(url, LOCK_OBJECT)
        except Exception:
            if not failed:  # else the save's own error is the one to see
                raise


def _lock_owner(data: bytes) -> dict | None:
    with contextlib.suppress(ValueError, RecursionError):
        owner = fmt.files.strict_loads(data)
        if (
            isinstance(owner, dict)
            and isinstance(owner.get("host"), str)
            and type(owner.get("pid")) is int
            and isinstance(owner.get("time"), (int, float))
            and isinstance(owner.get("token"), str)
        ):
            return owner
    return None


def _lock_is_stale(owner: dict | None, me: dict) -> bool:
    """A lock of this host whose process is gone (or of this process, not held any more)."""
    if owner is None or owner["host"] != me["host"]:
        return False
    if owner["pid"] == me["pid"]:
        return owner["token"] not in _held_locks
    return not liveness.pid_alive(owner["pid"])


class ObjectStorePrefix(Storage):
    """A checkpoint under an ``s3://`` / ``gs://`` prefix: no rename, so committed by its
    ``ucp.json``, written last and only if absent; locked by an object in the prefix."""

    no_manifest_hint = (
        " (or its save did not complete: an object-store checkpoint exists once its "
        f"{fmt.MANIFEST_FILE} is written)"
    )

    def join(self, *parts: str) -> str:
        return join(self.root, *parts)

    def kvstore(self, *subpath: str) -> dict:
        return kvstore_join(kvstore_root(self.root), *subpath)

    def read(self, name: str, limit: int) -> bytes | None:
        return read(self.root, name, limit)

    def exists(self, name: str) -> bool:
        return exists(self.root, name)

    def write(self, name: str, data: bytes) -> None:
        write(self.root, name, data)

    def names(self, prefix: str = "") -> list[str]:
        """Every object name under ``root`` (relative to it, nested ones too), each one a
        folder can hold (``base.held``; folder markers aside)."""
        memo = base.LISTINGS.get()  # listed once inside ``base.listed_once``
        if memo is None:
            return self._held(list_names(self.root, prefix))
        for (root, listed_prefix), names in list(memo.items()):  # a folder of a listed prefix
            under = self.root[len(root.rstrip("/")) + 1 :].strip("/") + "/"
            if not listed_prefix and self.root.startswith(root.rstrip("/") + "/") and under != "/":
                return [n[len(under) :] for n in names if n.startswith(under + prefix)]
        if (self.root, prefix) not in memo:
            memo[self.root, prefix] = self._held(list_names(self.root, prefix))
        return list(memo[self.root, prefix])

    def _held(self, names: list[str]) -> list[str]:
        return [n if n.endswith("/") else base.held(self.join(n), n) for n in names]

    def delete(self, names: list[str]) -> None:
        delete_names(self.root, names)

    def write_manifest(self, manifest: fmt.Manifest, name: str = fmt.MANIFEST_FILE) -> None:
        """One PUT, the commit: created only if absent, never over another save's commit."""
        if not create(self.root, name, manifest.dumps().encode()):
            raise RequestError(
                f"{join(self.root, name)}: already exists: another save committed this prefix "
                f"while this one was writing; this save is not committed."
            )

    def identity(self) -> str:
        return "url"  # an object-store checkpoint is never replaced (no rename there)

    def lock(self):
        return object_store_lock(self.root)

    def refuse_early(self, claim: Claim) -> None:
        """A malformed URL, or a committed checkpoint in the prefix, before anything is written."""
        kvstore_root(self.root)
        if exists(self.root, fmt.MANIFEST_FILE):
            claim.prefix(self)

    @contextlib.contextmanager
    def transaction(self, claim: Claim, *, kind: str, staged: bool, inner: str | None):
        """A prefix has no rename: the lock object, a killed save's leftovers deleted first
        (``claim``), the writer's conditional ``ucp.json`` the commit, this save's own objects
        deleted on failure."""
        self.refuse_early(claim)
        with self.lock():
            claim.prefix(self)
            tx = Transaction(self.root, self.root, replacing=False, staged=False)
            try:
                yield tx
                tx.commit()
            except BaseException:
                claim.failed(self)
                raise
