"""Where a checkpoint lives: a local directory, or a prefix in an object store.

``s3://bucket/path`` and ``gs://bucket/path`` are reached through TensorStore's own kvstore
drivers (``s3``, ``gcs``), for the arrays and for the few small files around them (``ucp.json``,
per-process digests), so one code path reads and writes both. Credentials and endpoints come
from the usual environment, read by TensorStore itself (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, profiles; ``GOOGLE_APPLICATION_CREDENTIALS``);
the endpoint and region from ``AWS_ENDPOINT_URL[_S3]`` / ``AWS_REGION`` (``AWS_DEFAULT_REGION``)
and the GCS endpoint from ``STORAGE_EMULATOR_HOST`` are put in the spec here, since TensorStore
does not read those. ``set_object_store_options`` overrides them per scheme.

An object store has no rename, so a checkpoint there is committed by writing ``ucp.json`` last:
a prefix without it is not a checkpoint (``docs/FORMAT.md``, "Object stores").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import CheckpointError, RequestError

SCHEMES = {"s3": "s3", "gs": "gcs"}  # URL scheme -> TensorStore kvstore driver
_options: dict[str, dict[str, Any]] = {}


def is_url(path: Any) -> bool:
    """True for ``s3://...`` / ``gs://...`` (an object-store checkpoint)."""
    return isinstance(path, str) and path.split("://", 1)[0] in SCHEMES and "://" in path


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
    elif os.environ.get("STORAGE_EMULATOR_HOST"):
        host = os.environ["STORAGE_EMULATOR_HOST"]
        spec.setdefault("context", {})["gcs_request_retries"] = {"max_retries": 2}
        os.environ.setdefault(
            "TENSORSTORE_GCS_HTTP_URL", host if "://" in host else f"http://{host}"
        )
    spec.update(_options.get(scheme, {}))
    return spec


def join(root: str, *parts: str) -> str:
    """``root`` joined with ``parts`` ("/"), for a URL or a local path."""
    if is_url(root):
        return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return os.path.join(root, *parts)


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


def read_manifest(root: str) -> fmt.Manifest:
    """The checkpoint's ``ucp.json`` (strictly validated), local or in an object store."""
    if not is_url(root):
        return fmt.read_manifest_file(root)
    where = join(root, fmt.MANIFEST_FILE)
    try:
        data = read(root, fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_BYTES)
    except RequestError as e:
        raise CheckpointError(str(e)) from None
    if data is None:
        raise CheckpointError(
            f"{where}: no manifest; {root} is not a jax_ucp checkpoint (or its save did not "
            f"complete: an object-store checkpoint exists once its {fmt.MANIFEST_FILE} is written)."
        )
    return fmt.Manifest.loads(data, where=where)


def write_manifest(root: str, manifest: fmt.Manifest, name: str = fmt.MANIFEST_FILE) -> None:
    """``ucp.json`` (or a part of it): for an object store, one PUT, the commit.

    Args:
        root: the checkpoint (a local directory or an object-store prefix)
        manifest: what to write
        name: the file name (``ucp.json``, or a part's name)
    """
    text = manifest.dumps()
    if is_url(root):  # created only if absent: never over another save's commit
        if not create(root, name, text.encode()):
            raise RequestError(
                f"{join(root, name)}: already exists: another save committed this prefix while "
                f"this one was writing; this save is not committed."
            )
        return
    with open(os.path.join(root, name), "w") as f:
        f.write(text)


def _successor(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix``."""
    data = bytearray(prefix.encode())
    while data and data[-1] == 0xFF:
        data.pop()
    if not data:
        return ""
    data[-1] += 1
    return data.decode(errors="surrogateescape")
