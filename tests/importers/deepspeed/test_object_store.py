"""A DeepSpeed ZeRO folder in an object store (``s3://`` / ``gs://`` on the local servers of
tests/object_servers.py) restored straight onto a mesh, read in place through its prefix's ``Storage``: its rank files'
bytes are fetched by ranged GETs as the import reads them. The tree equals the local folder's bit for bit; no byte is fetched twice; a weights-only
restore never fetches the Adam moments; a missing rank file, and an object truncated while it is
read, are errors naming the object."""

from __future__ import annotations

import os
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.store.storage import object_store, sparse
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.conversion import ImportOptions
from tests.restoring.test_remote_safetensors import _target
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)
ZERO = os.path.join(REPO, "tests", "fixtures", "deepspeed", "z1_fp32_dp2", "ckpt")
RANK_1 = "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def upload(path: str, bucket_url: str) -> str:
    """The file or folder ``path`` as objects under a fresh prefix of ``bucket_url``; its URL."""
    prefix = f"{bucket_url}/{os.path.basename(path)}-{uuid.uuid4().hex[:8]}"
    if os.path.isfile(path):
        with open(path, "rb") as f:
            object_store.write(prefix, os.path.basename(path), f.read())
        return object_store.join(prefix, os.path.basename(path))
    for name, data in folder_files(path).items():
        object_store.write(prefix, name, data)
    return prefix


def folder_files(path: str) -> dict[str, bytes]:
    """{name relative to the folder ``path``: its bytes} of every file under it."""
    files = {}
    for folder, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                files[os.path.relpath(f.name, path)] = f.read()
    return files


def size_of(path: str) -> int:
    """Bytes of the file, or of every file under the folder ``path``."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def assert_same(got, want) -> None:
    """Equal trees, bit for bit (NaNs and bf16 too), on the same shardings."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        assert getattr(a, "sharding", None) == getattr(b, "sharding", None)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def served(monkeypatch, server: tuple[dict, str] | None = None) -> str:
    """The environment of ``server`` (a fixture of tests/object_servers.py) set; its bucket URL.
    The fixtures' archives are small: read them by ranges as a large one is (a 1 KiB tail for
    the zip directory, each local header on its own), else one GET fetches them whole."""
    for k, v in (server or ({}, ""))[0].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sparse, "TAIL", 1024)
    monkeypatch.setattr(sparse, "HEAD", 64)
    monkeypatch.setattr(torch_zip, "HEADER_GAP", 0)
    return (server or ({}, ""))[1]


def fetched(call):
    """(what ``call()`` returns, the GETs and bytes it fetched into remote archives' copies)."""
    gets, nbytes = sparse.fetched()
    out = call()
    after = sparse.fetched()
    return out, after[0] - gets, after[1] - nbytes


def restores_as_local(src: str, bucket_url: str, **options) -> None:
    """``src`` uploaded under ``bucket_url`` restores onto a 2 x 4 mesh bit for bit as the
    local ``src`` does (and to host as well), no byte fetched twice."""
    url = upload(src, bucket_url)
    local = jax_ucp.restore(src, **options)
    target = _target(local, Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b")))
    remote, gets, nbytes = fetched(lambda: jax_ucp.restore(url, target=target, **options))
    assert_same(remote, jax_ucp.restore(src, target=target, **options))
    files = 1 if os.path.isfile(src) else sum(1 for _, _, ns in os.walk(src) for _ in ns)
    # no byte twice (but the two one-byte reads holding an archive's size to the object's)
    assert 0 < nbytes <= size_of(src) + 2 * files, (gets, nbytes)
    assert_same(jax_ucp.restore(url, **options), local)  # to host


def test_a_zero_folder_in_an_object_store_restores_as_the_local_folder(bucket_url, monkeypatch):
    served(monkeypatch)
    restores_as_local(ZERO, bucket_url)


def test_a_weights_only_restore_never_fetches_the_moments(s3_server, monkeypatch):
    url = upload(ZERO, served(monkeypatch, s3_server))
    moments = sum(x.nbytes for x in jax.tree.leaves(jax_ucp.restore(ZERO)["opt_state"]))
    weights = ImportOptions(weights_only=True)
    remote, gets, nbytes = fetched(lambda: jax_ucp.restore(url, importing=weights))
    assert_same(remote, jax_ucp.restore(ZERO, importing=weights))
    files = sum(1 for _, _, ns in os.walk(ZERO) for _ in ns)
    assert nbytes <= size_of(ZERO) - moments + 2 * files, (gets, nbytes, moments)


def test_a_missing_rank_object_is_an_error_naming_the_prefix(s3_server, monkeypatch):
    url = upload(ZERO, served(monkeypatch, s3_server))
    object_store.delete(url, RANK_1)
    with pytest.raises(jax_ucp.UCPError, match=rf"{url}/global_step2.*DP rank 1") as e:
        jax_ucp.restore(url)
    assert "ucp-view-" not in str(e.value)  # the URL, never the local view


def test_an_object_truncated_while_it_is_read_is_an_error_naming_it(s3_server, monkeypatch):
    url = upload(ZERO, served(monkeypatch, s3_server))
    assert registry.detect_format(url) == "deepspeed"  # the view built: directories fetched
    with open(os.path.join(ZERO, RANK_1), "rb") as f:
        data = f.read()
    object_store.write(url, RANK_1, data[: len(data) // 2])  # same name, half its bytes
    with pytest.raises(jax_ucp.UCPError, match=rf"{url}/{RANK_1}.*truncated"):
        jax_ucp.restore(url)


def test_a_truncated_rank_object_is_refused_naming_it(s3_server, monkeypatch):
    url = upload(ZERO, served(monkeypatch, s3_server))
    with open(os.path.join(ZERO, RANK_1), "rb") as f:
        object_store.write(url, RANK_1, f.read()[:-200])  # its zip directory cut
    with pytest.raises(jax_ucp.UCPError, match=rf"{url}/{RANK_1}.*(truncated|corrupt)") as e:
        jax_ucp.restore(url)
    assert "ucp-view-" not in str(e.value)


def test_a_zero_folder_in_an_object_store_converts_as_the_local_folder(
    s3_server, monkeypatch, tmp_path
):
    url = upload(ZERO, served(monkeypatch, s3_server))
    got = jax_ucp.convert(url, str(tmp_path / "remote"))
    assert_same(jax_ucp.restore(got), jax_ucp.restore(jax_ucp.convert(ZERO, str(tmp_path / "l"))))
    source = jax_ucp.inspect(got).source
    assert source["path"].startswith(url) and "ucp-view-" not in str(source)


TRAINER_DS = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "trainer_ds_z2", "checkpoint-3")


@pytest.mark.parametrize("src", [ZERO, TRAINER_DS], ids=["zero", "trainer"])
def test_a_deepspeed_folder_is_read_in_place(s3_server, monkeypatch, tmp_path, src):
    """No local view of the prefix: DeepSpeed's files, and a Trainer's beside its
    ``global_stepN/`` (its schedule, step, model config), read through the prefix's storage;
    the source recorded as the local folder's, naming the URL."""
    url = upload(src, served(monkeypatch, s3_server))

    local = jax_ucp.inspect(jax_ucp.convert(src, str(tmp_path / "local"))).source
    got = jax_ucp.convert(url, str(tmp_path / "remote"))
    assert_same(jax_ucp.restore(got), jax_ucp.restore(str(tmp_path / "local")))
    source = jax_ucp.inspect(got).source
    assert source["path"].startswith(url)
    assert source.get("trainer") == local.get("trainer")
    assert source.get("config") == local.get("config")
    assert ("trainer" in source) == (src == TRAINER_DS)


def test_a_zero_folder_in_a_hub_repo_restores_by_ranges(hub_server, monkeypatch):
    """The same through ``hf://`` (tests/object_servers.py's server with the Hub's layout): no
    rank file downloaded whole, the moments of a weights-only restore never fetched."""
    served(monkeypatch)
    files = folder_files(ZERO)
    hub_server.add("org/zero", files)
    assert_same(jax_ucp.restore("hf://org/zero"), jax_ucp.restore(ZERO))
    archives = [r for r in hub_server.log if r["path"].endswith(".pt") and r["method"] == "GET"]
    assert archives and all(r["range"] is not None for r in archives), "a rank file fetched whole"
    weights = ImportOptions(weights_only=True)
    moments = sum(x.nbytes for x in jax.tree.leaves(jax_ucp.restore(ZERO)["opt_state"]))
    remote, gets, nbytes = fetched(lambda: jax_ucp.restore("hf://org/zero", importing=weights))
    assert_same(remote, jax_ucp.restore(ZERO, importing=weights))
    assert nbytes <= size_of(ZERO) - moments + 2 * len(files), (gets, nbytes, moments)


@pytest.mark.parametrize("where", ["s3", "hub"])
def test_a_tracker_served_large_is_refused_unread(s3_server, hub_server, monkeypatch, where):
    """DeepSpeed's 12-byte ``latest`` served as a large object: refused naming it and the bound
    (on the Hub its size too) after at most the bound's bytes; before, the view fetched it whole
    (a 1.2 GB one cost 1.3 GB of memory) before its reader refused it."""
    big = b"global_step2" + b" " * 200_000
    if where == "s3":
        url = upload(ZERO, served(monkeypatch, s3_server))
        object_store.write(url, "latest", big)
        said = rf"{url}/latest: more than the 4096 bytes it may have: a record"
    else:
        served(monkeypatch)
        hub_server.add("org/zero", {**folder_files(ZERO), "latest": big})
        url = "hf://org/zero"
        said = r"hf://org/zero@\w+/latest: 200012 bytes, more than the 4096 it may have: a record"
    nbytes = sparse.fetched()[1]
    with pytest.raises(jax_ucp.UCPError, match=said):
        jax_ucp.restore(url)
    assert sparse.fetched()[1] - nbytes < 100_000
