"""s3:// and gs:// checkpoints, against real local servers on 127.0.0.1 (moto's S3 server and
``gcp-storage-emulator``, started once per test process by tests/object_servers.py). TensorStore's
own ``s3`` / ``gcs`` kvstore drivers do the I/O; credentials and endpoints come from the usual
environment variables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import jax_ucp
from jax_ucp._src.saving import engine
from jax_ucp._src.store.storage import object_store, storage_for
from jax_ucp._src.writer import commit
from jax_ucp.errors import RequestError, SourceError
from tests.ucp_testing import REPO, free_port, run_cli

pytestmark = pytest.mark.timeout(300)


def _new(url: str, name: str) -> str:
    return f"{url}/{name}-{time.time_ns()}"


def _mesh(shape):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("x", "y"))


def test_save_restore_onto_another_mesh_inspect_verify(bucket):
    _, root = bucket
    url = _new(root, "ck")
    w = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    e = (np.arange(40) - 7).astype(jax.numpy.bfloat16).reshape(8, 5)
    tree = {
        "params": {
            "w": jax.device_put(w, NamedSharding(_mesh((2, 4)), P("x", "y"))),
            "e": jax.device_put(e, NamedSharding(_mesh((2, 4)), P())),
        },
        "step": 7,
    }
    assert jax_ucp.save(url, tree) == url
    target = _mesh((4, 2))
    out = jax_ucp.restore(
        url,
        shardings={
            "params": {
                "w": NamedSharding(target, P("y", "x")),
                "e": NamedSharding(target, P("x")),
            },
            "step": None,
        },
    )
    assert out["params"]["w"].sharding.spec == P("y", "x")
    assert np.asarray(out["params"]["w"]).tobytes() == w.tobytes()
    assert np.asarray(out["params"]["e"]).tobytes() == e.tobytes()
    assert out["step"] == 7
    m = jax_ucp.inspect(url)
    assert m.kvstore.driver == ("s3" if url.startswith("s3") else "gcs")
    assert sorted(e.name for e in m.tensors) == ["params/e", "params/w"]
    assert jax_ucp.verify(url) == []
    with pytest.raises(FileExistsError, match="already exists"):
        jax_ucp.save(url, tree)
    with pytest.raises(jax_ucp.UCPError, match="no atomic rename"):
        jax_ucp.save(url, tree, force=True)
    assert np.asarray(jax_ucp.restore(url)["params"]["w"]).tobytes() == w.tobytes()


def test_swapped_or_missing_shard_objects_are_errors(bucket):
    """Each shard object's digest is in ucp.json, as for files: two shard objects swapped
    (each chunk still passes its crc32c) or one deleted is an error naming the object, never
    the wrong values."""
    from jax_ucp._src.store.storage import object_store

    _, root = bucket
    url = _new(root, "swap")
    w = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    jax_ucp.save(url, {"w": jax.device_put(w, NamedSharding(_mesh((2, 4)), P("x", "y")))})
    (entry,) = jax_ucp.inspect(url).tensors
    assert sorted(entry.shard_digests) == [f"c/{i}/{j}" for i in range(2) for j in range(4)]
    a, b = f"{entry.dir}/c/0/0", f"{entry.dir}/c/1/3"
    first, second = object_store.read(url, a, 1 << 20), object_store.read(url, b, 1 << 20)
    assert first != second and len(first) == len(second)
    object_store.write(url, a, second)
    object_store.write(url, b, first)
    with pytest.raises(jax_ucp.UCPError, match=r"c/0/0.*shard file"):
        jax_ucp.restore(url)
    assert any("c/0/0 is not the shard file" in message for _, message in jax_ucp.verify(url))
    object_store.write(url, a, first)
    object_store.write(url, b, second)
    assert np.asarray(jax_ucp.restore(url)["w"]).tobytes() == w.tobytes()
    object_store.delete(url, b)
    with pytest.raises(jax_ucp.UCPError, match=r"c/1/3 is missing"):
        jax_ucp.restore(url)


def test_a_shard_object_cut_short_or_emptied_is_named_with_its_size(bucket):
    """A shard object cut short (in its data or its index) or emptied: restore and verify name
    the object, the bytes it holds and why, never TensorStore's raw OUT_OF_RANGE (or the
    server's XML error body for an empty object), as before."""
    _, root = bucket
    url = _new(root, "short")
    w = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    jax_ucp.save(url, {"w": jax.device_put(w, NamedSharding(_mesh((2, 4)), P("x", "y")))})
    (entry,) = jax_ucp.inspect(url).tensors
    key = f"{entry.dir}/c/0/0"
    whole = object_store.read(url, key, 1 << 20)
    # the GCS emulator answers a range of an empty object with no reply at all: S3 only
    for kept in (len(whole) // 2, len(whole) - 3, *((0,) if url.startswith("s3") else ())):
        object_store.write(url, key, whole[:kept])
        held = rf"it holds {kept} bytes: " if kept else ""  # S3's 416 for an empty one: no size
        said = rf"c/0/0: shorter than this checkpoint's save wrote it \({held}cut short"
        with pytest.raises(jax_ucp.UCPError, match=said) as refused:
            jax_ucp.restore(url)
        assert "OUT_OF_RANGE" not in str(refused.value)
        assert any(re.search(said, message) for _, message in jax_ucp.verify(url))
    object_store.write(url, key, whole)
    assert np.asarray(jax_ucp.restore(url)["w"]).tobytes() == w.tobytes()


def test_an_array_metadata_object_unlike_the_manifest_is_refused(bucket):
    """An array's zarr.json is checked against its manifest entry while its shard objects are
    fetched (issue 69): one member changed (big-endian: every value byte-swapped if believed),
    one too large or missing is still refused naming the object, onto a mesh, to host and by
    select=, and its error comes first when a shard object is also wrong."""
    _, root = bucket
    url = _new(root, "meta")
    w = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    jax_ucp.save(url, {"w": jax.device_put(w, NamedSharding(_mesh((2, 4)), P("x", "y")))})
    (entry,) = jax_ucp.inspect(url).tensors
    name = f"{entry.dir}/zarr.json"
    good = object_store.read(url, name, 1 << 14)
    assert good is not None and b'"little"' in good
    onto = {"w": NamedSharding(_mesh((4, 2)), P("y", "x"))}
    for data, said in [
        (good.replace(b'"little"', b'"big"'), r"zarr\.json.*endian"),
        (good + b" " * (1 << 14), r"zarr\.json: more than the 16384 bytes"),
        (None, r"array metadata .*zarr\.json is missing"),
    ]:
        if data is None:
            object_store.delete(url, name)
        else:
            object_store.write(url, name, data)
        for kw in ({"shardings": onto}, {}, {"select": "w"}):
            with pytest.raises(jax_ucp.UCPError, match=said):
                jax_ucp.restore(url, **kw)
    object_store.write(url, name, good.replace(b'"little"', b'"big"'))
    shard = f"{entry.dir}/c/0/0"
    whole = object_store.read(url, shard, 1 << 20)
    object_store.write(url, shard, whole[: len(whole) // 2])
    with pytest.raises(jax_ucp.UCPError, match=r"zarr\.json.*endian"):
        jax_ucp.restore(url)
    object_store.write(url, shard, whole)
    object_store.write(url, name, good)
    assert np.asarray(jax_ucp.restore(url, shardings=onto)["w"]).tobytes() == w.tobytes()


def test_an_array_metadata_fetch_waited_for_before_its_size_is_known_completes():
    """The zarr.json's second GET is issued by a callback when its size probe answers; a
    restore whose chunk reads finished first waits for the probe meanwhile. Waiting while
    holding the lock that callback takes hung (TensorStore runs the callback before it wakes
    the waiter): the wait now ends with the content, the probe answered from another thread."""
    import threading

    import tensorstore as ts

    from jax_ucp._src.restoring.sources import ucp_source

    probe, probed = ts.Promise.new()
    asked = []

    class Store:  # answers the probe when the test says; the whole object at once
        def read(self, name, byte_range=None):
            asked.append(byte_range)
            if byte_range is not None:
                return probed
            done, future = ts.Promise.new()
            done.set_result(ts.KvStore.ReadResult(state="value", value=b"{}"))
            return future

    fetch = ucp_source.ObjectFetch("arrays/w/zarr.json", Store())
    got = []
    waiter = threading.Thread(target=lambda: got.append(fetch.result(Store())), daemon=True)
    waiter.start()
    time.sleep(0.2)  # the waiter waits on the probe
    past_the_end = ValueError("OUT_OF_RANGE: the range starts past the end")
    threading.Thread(target=lambda: probe.set_exception(past_the_end), daemon=True).start()
    waiter.join(30)
    assert not waiter.is_alive(), "waiting for the probe hung"
    assert got == [b"{}"] and asked[0] == slice(1 << 14, (1 << 14) + 1) and asked[1:] == [None]


def test_a_save_that_did_not_commit_is_never_a_checkpoint(bucket):
    """Killed before its ucp.json: restore/inspect/verify say it is no checkpoint; the next
    save to the prefix deletes the leftovers and commits only its own objects."""
    _, root = bucket
    url = _new(root, "killed")
    sibling = url + "-sibling"  # shares the prefix text: cleanup must not touch it
    jax_ucp.save(sibling, {"keep": np.full(3, 2.0, np.float32)})

    def killed(save, process_count):
        raise KeyboardInterrupt("killed before the commit")

    real = engine.merge
    real_cleanup = commit.remove_object_store_leftovers
    engine.merge = killed  # not monkeypatch: undo() would drop the env
    commit.remove_object_store_leftovers = lambda url: None  # a killed save cleans up nothing
    try:
        with pytest.raises(KeyboardInterrupt):
            jax_ucp.save(url, {"old": np.ones((4, 4), np.float32), "w": np.zeros(3, np.float32)})
    finally:
        engine.merge = real
        commit.remove_object_store_leftovers = real_cleanup
    assert any(n.startswith("arrays/") for n in object_store.list_names(url))  # the data is there
    for read in (jax_ucp.restore, jax_ucp.inspect, jax_ucp.verify):
        with pytest.raises(jax_ucp.UCPError, match="did not complete"):
            read(url)
    jax_ucp.save(url, {"w": np.arange(3, dtype=np.float32)})
    assert not [n for n in object_store.list_names(url) if "old" in n]
    assert (
        np.asarray(jax_ucp.restore(url)["w"]).tobytes() == np.arange(3, dtype=np.float32).tobytes()
    )
    assert jax_ucp.verify(sibling) == [] and list(jax_ucp.restore(sibling)) == ["keep"]


def test_a_failed_save_removes_its_own_objects_and_its_lock(bucket):
    """The save's transaction on a prefix: a save that fails before its ucp.json deletes the
    objects it wrote and releases the lock object, so the prefix is as it was (empty)."""
    _, root = bucket
    url = _new(root, "failed")

    def broken(save, process_count):
        raise OSError(28, "No space left on device")

    real = engine.merge
    engine.merge = broken  # not monkeypatch: undo() would drop the env
    try:
        with pytest.raises(OSError, match="No space left"):
            jax_ucp.save(url, {"w": np.zeros((4, 4), np.float32)})
    finally:
        engine.merge = real
    assert object_store.list_names(url) == []
    jax_ucp.save(url, {"w": np.ones(3, np.float32)})  # no lock left behind
    assert np.asarray(jax_ucp.restore(url)["w"]).tolist() == [1.0, 1.0, 1.0]


def test_convert_and_cli_with_urls(bucket, tmp_path):
    env, root = bucket
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((32, 16)).astype(np.float32),
        "model.norm.weight": np.ones(16, np.float32),
    }
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    url = _new(root, "converted")
    assert jax_ucp.convert(str(tmp_path / "hf"), url) == url
    got = jax_ucp.restore(url)["params"]
    for name, value in tensors.items():
        assert np.asarray(got[name]).tobytes() == value.tobytes(), name

    def cli(*args):
        return run_cli(*args, env=env, timeout=120)

    r = cli("inspect", url)
    assert r.returncode == 0 and "model.embed_tokens.weight" in r.stdout, r.stdout + r.stderr
    r = cli("verify", url)
    assert r.returncode == 0 and "read back intact" in r.stdout, r.stdout + r.stderr
    second = _new(root, "cli")
    r = cli("convert", str(tmp_path / "hf"), second, "--from", "safetensors")
    assert r.returncode == 0, r.stdout + r.stderr
    assert jax_ucp.inspect(second).source["framework"] == "safetensors"
    with pytest.raises(ValueError, match="object store"):
        jax_ucp.convert(str(tmp_path / "hf"), _new(root, "step"), step=1)


@pytest.mark.parametrize(
    "url, message",
    [
        ("s3://only-a-bucket", "never a bucket root"),
        ("s3://bucket/a/../b", r"'\.\.' path components"),
        ("gs://bucket//x", "empty"),
    ],
)
def test_malformed_urls_are_refused(url, message):
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.save(url, {"w": np.zeros(2, np.float32)})


MULTI = r"""
import sys
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
pid, n, port, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n,
                           process_id=pid, initialization_timeout=120)
import jax_ucp
mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
W = np.arange(128 * 96, dtype=np.float32).reshape(128, 96)
w = jax.make_array_from_callback(W.shape, NamedSharding(mesh, P("data", "model")), lambda i: W[i])
jax_ucp.save(url, {"w": w, "step": 5})
out = jax_ucp.restore(url, shardings={"w": NamedSharding(mesh, P("model", "data")), "step": None})
for s in out["w"].addressable_shards:
    assert np.array_equal(np.asarray(s.data), W[s.index])
print("OK", pid)
"""


def test_two_processes_save_to_the_object_store(bucket):
    """The real multi-host path (2 processes x 2 CPU devices, jax.distributed on 127.0.0.1):
    each process writes only its own shards to the bucket; process 0 commits ucp.json last."""
    env, root = bucket
    url = _new(root, "multi")
    port = str(free_port())
    run_env = dict(
        os.environ,
        **env,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=REPO,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI, str(i), "2", port, url],
            env=run_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
    w = np.arange(128 * 96, dtype=np.float32).reshape(128, 96)
    assert np.asarray(jax_ucp.restore(url)["w"]).tobytes() == w.tobytes()
    assert not [n for n in object_store.list_names(url) if n.startswith("ucp.digests")]


def test_checkpoint_manager_on_an_object_store(bucket):
    """Orbax's CheckpointManager on s3:// and gs:// (Orbax reaches them through etils.epath:
    s3fs / gcsfs), each step committed by Orbax's commit_success.txt, no rename: steps kept and
    deleted by max_to_keep, restored onto another mesh; a step whose save never committed is
    never listed; on s3:// Orbax's default rename-to-commit is refused with the way out."""
    import orbax.checkpoint as ocp

    _, root = bucket
    url = _new(root, "run")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2, temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
    )
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    sharded = jax.device_put(w, NamedSharding(_mesh((2, 4)), P("x", "y")))
    with ocp.CheckpointManager(url, options=options) as mngr:
        for step in range(3):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=jax_ucp.UCPSave({"w": sharded + step}),
                    meta=ocp.args.JsonSave({"step": step}),
                ),
            )
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        out = mngr.restore(
            2,
            args=ocp.args.Composite(
                state=jax_ucp.UCPRestore(mesh=_mesh((4, 2))), meta=ocp.args.JsonRestore()
            ),
        )
    assert out.meta == {"step": 2}
    assert out.state["w"].sharding.mesh.shape == {"x": 4, "y": 2}
    assert np.asarray(out.state["w"]).tobytes() == (w + 2).tobytes()
    assert np.asarray(jax_ucp.restore(f"{url}/2")["w"]).tobytes() == (w + 2).tobytes()
    assert not object_store.list_names(url, "0/")  # deleted by max_to_keep
    # A save killed before Orbax committed it: all its objects but commit_success.txt.
    for name in object_store.list_names(url, "2/"):
        if not name.endswith("commit_success.txt"):
            object_store.write(url, "7/" + name[2:], object_store.read(url, name, 1 << 20))
    with ocp.CheckpointManager(url, options=options) as mngr:
        assert 7 not in mngr.all_steps() and mngr.latest_step() == 2
    if url.startswith("s3://"):  # Orbax's default there: a temporary prefix renamed at the end
        with (
            pytest.raises(Exception, match="CommitFileTemporaryPath"),
            ocp.CheckpointManager(_new(root, "renamed")) as mngr,
        ):
            mngr.save(0, args=ocp.args.Composite(state=jax_ucp.UCPSave({"w": sharded})))
            mngr.wait_until_finished()


def test_explicit_options_override_the_environment(s3_server, monkeypatch):
    """``set_object_store_options`` reaches a server the environment does not name: with
    AWS_ENDPOINT_URL pointing at a closed port, the explicit endpoint is the one used."""
    env, root = s3_server
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.delenv("AWS_REGION")
    with pytest.raises(RequestError, match=r"'bucket'.*URL"):
        jax_ucp.set_object_store_options("s3", bucket="other")
    jax_ucp.set_object_store_options(
        "s3", endpoint=env["AWS_ENDPOINT_URL"], aws_region=env["AWS_REGION"]
    )
    try:
        url = _new(root, "explicit")
        w = np.arange(48 * 32, dtype=np.float32).reshape(48, 32)
        jax_ucp.save(url, {"w": jax.device_put(w, NamedSharding(_mesh((2, 4)), P("x", "y")))})
        got = jax_ucp.restore(url, mesh=_mesh((4, 2)))["w"]
        assert np.asarray(got).tobytes() == w.tobytes()
        assert object_store.kvstore_root(url)["endpoint"] == env["AWS_ENDPOINT_URL"]
    finally:
        jax_ucp.set_object_store_options("s3", endpoint=None, aws_region=None)
    assert object_store.kvstore_root(url)["endpoint"] != env["AWS_ENDPOINT_URL"]


def test_no_sdk_noise_on_stderr_without_credential_files(bucket, tmp_path, monkeypatch):
    """Every s3 operation printed the AWS SDK's ``E1126 ... Failed to open file
    '/root/.aws/config'`` lines when the keys come from the environment and there are no AWS
    files (issue 56): the environment is named as the credentials' source then. Through the GCS
    emulator, ``E1126 ... Could not find the credentials file``: an emulator takes none."""
    env, root = bucket
    for set_here in ("TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING"):
        monkeypatch.delenv(set_here, raising=False)  # by an earlier gs test of this process
    url = _new(root, "quiet")
    home = tmp_path / "home"  # no ~/.aws here
    home.mkdir()
    quiet = {**env, "HOME": str(home)}
    code = f"import numpy as np, jax_ucp; jax_ucp.save({url!r}, {{'w': np.ones(4, np.float32)}})"
    p = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **quiet, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    r = run_cli("verify", url, env=quiet)
    assert r.returncode == 0, r.stderr[-2000:]
    for out in (p.stderr, r.stderr):
        assert ".aws/" not in out and "credentials file" not in out, out[-2000:]


def test_a_listing_naming_an_object_no_folder_holds_is_refused_by_the_listing(bucket):
    """An object name with an empty part (the servers keep it; '..' and '.' ones: test_hub's
    listing): the prefix's listing
    refuses it, naming it (``base.held``, the Hub's one check too), whoever lists; before, only
    the importers' open stage looked, after asking whether the source was local. A folder
    marker (``sub/``) is no file."""
    _, root = bucket
    url = _new(root, "odd")
    for ok in ("w.json", "sub/"):
        object_store.write(url, ok, b"{}")
    prefix = storage_for(url)
    assert prefix.names() == ["sub/", "w.json"]
    prefix.check_listing()
    name = "x//y.json"
    object_store.write(url, name, b"{}")
    with pytest.raises(SourceError, match="an object name the folder cannot hold") as e:
        prefix.check_listing()
    assert name in str(e.value)
