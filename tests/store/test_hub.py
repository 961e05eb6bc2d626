"""A Hugging Face Hub repo read in place (``hf://ORG/NAME[@REVISION]``) from a local server with
the Hub's layout (tests/object_servers.py ``hub_server``: the API's model info, ``resolve``
with a redirect of each safetensors file to a CDN on another port, ``Range`` there; never the
network): restored onto a 2 x 4 mesh bit-exact, each device's rows fetched as their byte ranges
and nothing else; converted (the manifest names the commit); a revision pinned once per read; a
missing repo, revision or file, a write and a redirect off http(s) refused by name."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save

import jax_ucp
from jax_ucp._src.importers import safetensors_weights
from jax_ucp._src.store.storage import hub
from tests.object_servers import HubServer
from tests.ucp_testing import run_cli, run_workers

pytestmark = pytest.mark.timeout(300)


def synthetic_repo(seed: int = 0) -> tuple[dict[str, bytes], dict[str, np.ndarray]]:
    """(files, arrays) of a sharded Hub repo: two safetensors files, their index, config.json."""
    rng = np.random.default_rng(seed)
    a = {
        "w": rng.standard_normal((16, 24)).astype(np.float32),
        "b": rng.standard_normal(24).astype(np.float16),
        "s": np.asarray(3.5 + seed, np.float32),
    }
    b = {"layers.0.proj": rng.standard_normal((8, 12)).astype(np.float32)}
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {n: names[0] for n in a} | {n: names[1] for n in b}
    files = {
        names[0]: save(a),
        names[1]: save(b),
        "model.safetensors.index.json": json.dumps({"weight_map": weight_map}).encode(),
        "config.json": b'{"model_type": "synthetic"}',
    }
    return files, a | b


@pytest.fixture
def repo(hub_server, monkeypatch):
    """The synthetic repo, its objects read by ranges as large ones are (not whole: small)."""
    monkeypatch.setattr(safetensors_weights, "SMALL_OBJECT", 0)
    files, arrays = synthetic_repo()
    hub_server.add("org/model", files)
    return hub_server, arrays


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def _spec(shape) -> P:
    spec: list[str | None] = [None] * len(shape)
    if shape and shape[0] % 2 == 0:
        spec[0] = "a"
    if len(shape) > 1 and shape[-1] % 4 == 0:
        spec[-1] = "b"
    return P(*spec)


def _target(arrays, mesh):
    return {
        "params": {
            n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x.shape)))
            for n, x in arrays.items()
        }
    }


def _needed_ranges(files, mesh, devices=None) -> set[tuple[str, int, int]]:
    """(file, start, stop) of every row block ``devices`` (all the mesh's) hold: whole rows,
    each distinct block once (from the files' own headers)."""
    needed = set()
    for name, data in files.items():
        if not name.endswith(".safetensors"):
            continue
        n = int.from_bytes(data[:8], "little")
        for key, entry in json.loads(data[8 : 8 + n]).items():
            if key == "__metadata__":
                continue
            shape, (begin, end) = entry["shape"], entry["data_offsets"]
            start = 8 + n + begin
            if not shape:
                needed.add((name, start, 8 + n + end))
                continue
            row = (end - begin) // shape[0]
            sharding = NamedSharding(mesh, _spec(shape))
            for device, index in sharding.devices_indices_map(tuple(shape)).items():
                if devices is not None and device not in devices:
                    continue
                a, b, _ = index[0].indices(shape[0])
                needed.add((name, start + a * row, start + b * row))
    return needed


def test_a_sharded_repo_restores_onto_a_mesh_fetching_only_the_rows_needed(repo, tmp_path):
    server, arrays = repo
    mesh = _mesh()
    files = server.file_commit("org/model")
    server.log.clear()
    out = jax_ucp.restore("hf://org/model", target=_target(arrays, mesh))
    for name, want in arrays.items():
        got = out["params"][name]
        assert got.sharding == NamedSharding(mesh, _spec(want.shape)) and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    cdn = [r for r in server.log if r["server"] == "cdn"]
    assert cdn and all(r["range"] is not None for r in cdn), "a whole file was downloaded"
    assert all(r["authorization"] is None for r in cdn), "the token went to the CDN"
    _only_needed(cdn, files, _needed_ranges(files, mesh))
    replicated = jax_ucp.restore("hf://org/model", mesh=mesh)["params"]  # no saved sharding
    for name, want in arrays.items():
        np.testing.assert_array_equal(np.asarray(replicated[name]), want)
    host = jax_ucp.restore("hf://org/model/model-00002-of-00002.safetensors")
    np.testing.assert_array_equal(host["params"]["layers.0.proj"], arrays["layers.0.proj"])


def test_a_small_object_is_fetched_in_one_get_its_tensors_cut_from_it(hub_server):
    """Each safetensors file under ``SMALL_OBJECT``: its header read (its length, the header,
    the one-byte size checks), then all its tensors in one GET, whatever a restore asks."""
    files, arrays = synthetic_repo()
    hub_server.add("org/small", files)
    out = jax_ucp.restore("hf://org/small", target=_target(arrays, _mesh()))
    for name, want in arrays.items():
        np.testing.assert_array_equal(np.asarray(out["params"][name]), want)
    for name in (n for n in files if n.endswith(".safetensors")):
        n = int.from_bytes(files[name][:8], "little")
        gets = [
            (r["start"], r["stop"])
            for r in hub_server.log
            if r["server"] == "cdn" and r["path"] == name
        ]
        whole = [g for g in gets if g not in ((0, 8), (8, 8 + n)) and g[1] - g[0] > 1]
        assert whole == [(8 + n, len(files[name]))] and len(gets) <= 5, (name, gets)


def test_a_single_file_repo_restores_and_converts(hub_server, tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_weights, "SMALL_OBJECT", 0)  # read by ranges
    files, arrays = synthetic_repo(2)
    one = {"model.safetensors": save(arrays), "config.json": files["config.json"]}
    sha = hub_server.add("org/single", one)
    mesh = _mesh()
    out = jax_ucp.restore("hf://org/single@main", target=_target(arrays, mesh))
    for name, want in arrays.items():
        np.testing.assert_array_equal(np.asarray(out["params"][name]), want)
    cdn = [r for r in hub_server.log if r["server"] == "cdn"]
    _only_needed(cdn, one, _needed_ranges(one, mesh))
    hub_server.log.clear()
    dest = jax_ucp.convert("hf://org/single", tmp_path / "one")
    assert jax_ucp.inspect(dest).source["path"] == f"hf://org/single@{sha}"
    cdn = [r for r in hub_server.log if r["server"] == "cdn"]
    assert cdn and all(r["range"] is not None for r in cdn), "a whole file was downloaded"
    back = jax_ucp.restore(dest)["params"]
    for name, want in arrays.items():
        np.testing.assert_array_equal(back[name], want)


def test_a_spec_on_a_mesh_reads_the_hub_as_the_local_folder(hub_server, tmp_path):
    """``restore(hf://..., mesh=, spec=hf_llama)``: the flax tree, each tensor as the same
    restore of the folder gives it (the spec's views over ranged reads)."""
    from jax_ucp.language import load_spec
    from jax_ucp.models import LMConfig
    from tests.restoring.test_safetensors_source import _llama, _sharded_folder

    folder = _sharded_folder(tmp_path / "hf", _llama(np.random.default_rng(2)))
    hub_server.add("org/llama", {p.name: p.read_bytes() for p in folder.iterdir()})
    config = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 64}  # fmt: skip
    spec = load_spec("hf_llama", **LMConfig.from_hf_llama(config).head_settings)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    hub, local = (jax_ucp.restore(p, mesh=mesh, spec=spec) for p in ("hf://org/llama", folder))
    flat = jax.tree_util.tree_flatten_with_path
    assert jax.tree.structure(hub) == jax.tree.structure(local)
    for (path, x), (_, y) in zip(flat(hub)[0], flat(local)[0]):
        assert x.sharding == y.sharding and x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _only_needed(requests, files, needed) -> int:
    """The ranges ``requests`` fetched are exactly ``needed`` besides each file's header (its
    length, then the header) and the one-byte reads that check its size: their bytes."""
    fetched = {(r["path"], r["start"], r["stop"]) for r in requests}
    assert requests and needed <= fetched
    for name, start, stop in fetched - needed:
        n = int.from_bytes(files[name][:8], "little")
        assert (start, stop) in ((0, 8), (8, 8 + n)) or stop - start == 1, (name, start, stop)
    data_bytes = sum(b - a for _, a, b in needed)
    assert data_bytes < sum(len(v) for k, v in files.items() if k.endswith(".safetensors"))
    return data_bytes


WORKER = r"""
import os, sys
pid, port, endpoints, want = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4]
os.environ["HF_ENDPOINT"] = endpoints[pid]  # each process its own server: its own request log
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=120)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ucp
from jax_ucp._src import store
from jax_ucp._src.importers import safetensors_weights
safetensors_weights.SMALL_OBJECT = 0  # read by ranges, as a large object is
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
assert {d.process_index for d in mesh.devices[pid]} == {pid}
arrays = dict(np.load(want))
def spec(shape):
    s = [None] * len(shape)
    if shape and shape[0] % 2 == 0:
        s[0] = "a"
    if len(shape) > 1 and shape[-1] % 4 == 0:
        s[-1] = "b"
    return P(*s)
target = {"params": {n: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                             sharding=NamedSharding(mesh, spec(x.shape)))
                     for n, x in arrays.items()}}
before = store.bytes_read()
out = jax_ucp.restore("hf://org/model", target=target)
read = store.bytes_read() - before
for n, x in arrays.items():
    for s in out["params"][n].addressable_shards:
        assert np.array_equal(np.asarray(s.data), x[s.index]), n
print("READ", read)
"""


def test_each_process_fetches_only_its_devices_rows(repo, tmp_path):
    """A 2-process job (4 CPU devices each) on one 2 x 4 mesh: each process fetches the rows of
    its own devices, counted at its own server and by ``store.bytes_read``; both read the
    commit process 0 resolved, though ``main`` moved on at process 1's server."""
    server, arrays = repo
    files = server.file_commit("org/model")
    other = HubServer()  # the second process's server, the same repo at the same commit
    try:
        other.add("org/model", files)
        other.add("org/model", synthetic_repo(1)[0])  # a push process 0 did not see
        np.savez(tmp_path / "want.npz", **arrays)
        endpoints = f"{server.endpoint},{other.endpoint}"
        server.log.clear()
        results = run_workers(
            tmp_path, WORKER, endpoints, str(tmp_path / "want.npz"), devices=4, timeout=240
        )
        for code, _, err in results:
            assert code == 0, err[-3000:]
        mesh = _mesh()  # this process's 8 devices stand for the job's, position by position
        for p, s in enumerate((server, other)):
            cdn = [r for r in s.log if r["server"] == "cdn"]
            data_bytes = _only_needed(cdn, files, _needed_ranges(files, mesh, set(mesh.devices[p])))
            read = int(results[p][1].split("READ ")[1].split()[0])
            assert read == data_bytes, (p, read, data_bytes)
    finally:
        other.close()


def test_convert_records_the_commit_and_restores_equal(repo, tmp_path):
    server, arrays = repo
    sha = server.repos["org/model"]["refs"]["main"]
    dest = jax_ucp.convert("hf://org/model", tmp_path / "ucp")
    source = jax_ucp.inspect(dest).source
    assert source["path"] == f"hf://org/model@{sha}"
    assert source["files"] == sorted(
        n for n in server.file_commit("org/model") if n.endswith(".safetensors")
    )
    back = jax_ucp.restore(dest)
    for name, want in arrays.items():
        np.testing.assert_array_equal(back["params"][name], want)
    inspected = jax_ucp.inspect("hf://org/model")
    assert [(t.name, t.shape, t.dtype) for t in inspected.tensors] == [
        (t.name, t.shape, t.dtype) for t in jax_ucp.inspect(dest).tensors
    ]
    assert inspected.source["path"] == f"hf://org/model@{sha}"
    server.log.clear()
    planned = jax_ucp.plan("hf://org/model", target=_target(arrays, _mesh()))
    assert sorted(t.name for t in planned.tensors) == sorted(f"params/{n}" for n in arrays)
    assert not planned.errors
    files = server.file_commit("org/model")
    cdn = [r for r in server.log if r["server"] == "cdn"]
    _only_needed(cdn, files, set())  # a plan reads the headers alone


def test_the_cli_converts_and_inspects_a_hub_repo(repo, tmp_path):
    server, _ = repo
    env = {"HF_ENDPOINT": server.endpoint}
    done = run_cli("convert", "hf://org/model", str(tmp_path / "cli"), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = run_cli("inspect", "hf://org/model", env=env)
    assert shown.returncode == 0 and "layers.0.proj" in shown.stdout, shown.stderr[-2000:]


def test_a_revision_is_pinned_for_the_whole_read(hub_server, tmp_path):
    old_files, old = synthetic_repo(0)
    new_files, new = synthetic_repo(1)
    first = hub_server.add("org/model", old_files)
    second = hub_server.add("org/model", new_files)  # main now points here
    pinned = jax_ucp.restore(f"hf://org/model@{first}")
    np.testing.assert_array_equal(pinned["params"]["w"], old["w"])
    assert jax_ucp.restore("hf://org/model")["params"]["s"] == new["s"]
    # a push after every listing: each read stays at the commit it listed, never a mix
    hub_server.push_after_each_listing("org/model", [first, second])
    for _ in range(2):
        during = jax_ucp.restore("hf://org/model")["params"]
        assert any(all(np.array_equal(during[n], w[n]) for n in w) for w in (old, new))
        dest = jax_ucp.convert("hf://org/model", tmp_path / f"c{_}")
        sha = jax_ucp.inspect(dest).source["path"].rpartition("@")[2]
        converted = jax_ucp.restore(dest)["params"]
        for name, want in (old if sha == first else new).items():
            np.testing.assert_array_equal(converted[name], want)
    assert hub.HubRepo(f"hf://org/model@{second}").sha == second


def test_missing_repo_revision_and_file_are_named(repo, hub_server):
    with pytest.raises(jax_ucp.UCPError, match="no model repo 'org/absent'"):
        jax_ucp.restore("hf://org/absent")
    with pytest.raises(jax_ucp.UCPError, match="revision 'v9'"):
        jax_ucp.restore("hf://org/model@v9")
    files, _ = synthetic_repo()
    del files["model-00002-of-00002.safetensors"]
    hub_server.add("org/broken", files)
    with pytest.raises(jax_ucp.UCPError, match=r"model-00002-of-00002\.safetensors"):
        jax_ucp.restore("hf://org/broken")
    with pytest.raises(jax_ucp.UCPError, match="read-only"):
        jax_ucp.save("hf://org/model", {"x": np.zeros(2)})
    for bad in ("hf://org/../model", "hf://org", "hf://org/model/a/../b"):
        with pytest.raises(jax_ucp.UCPError, match=r"expected|not allowed"):
            hub.HubRepo(bad)


def test_a_redirect_off_http_or_in_a_loop_is_refused(repo, hub_server):
    hub_server.redirect_to = "file:///etc/passwd"
    with pytest.raises(jax_ucp.UCPError, match="only http"):
        jax_ucp.restore("hf://org/model")
    hub_server.redirect_to = "/org/model/resolve/main/model-00001-of-00002.safetensors"
    with pytest.raises(jax_ucp.UCPError, match="more than 5 redirects"):
        jax_ucp.restore("hf://org/model")


def test_the_token_never_goes_over_http_from_an_https_endpoint(monkeypatch):
    """A hop from the https endpoint to http on the same host (a downgrade) gets no token, as
    ``huggingface_hub``'s requests strips it; before: sent in clear text (only the host was
    compared)."""
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    monkeypatch.setenv("HF_TOKEN", HubServer.TOKEN)
    assert hub.auth_headers("https://hub.example/org/m/resolve/x") == {
        "Authorization": f"Bearer {HubServer.TOKEN}"
    }
    for other in (
        "http://hub.example/org/m",
        "https://cdn.example/x",
        "https://hub.example:8443/x",
    ):
        assert hub.auth_headers(other) == {}


@pytest.mark.parametrize("name", ["../evil.bin", "/etc/passwd", "a\x00b.json", "x//y.json"])
def test_a_listed_name_no_folder_holds_is_named_not_no_manifest(hub_server, monkeypatch, name):
    """A repo of torch archives (read through a local view of it) whose listing names a file
    through '..', absolutely, with a NUL or an empty part (synthetic): a ``SourceError``
    naming that file. Before: a raw ``ValueError`` ("embedded null byte") or "no ucp.json
    here ... not a jax_ucp checkpoint" (the view's refusal taken for "no importer claims
    it"). A folder marker (``sub/``) is no file: that repo restores as the folder does."""
    from tests.importers.deepspeed.test_object_store import assert_same
    from tests.importers.torch.test_object_store import HF_BIN_SHARDED, files_of

    files = files_of(HF_BIN_SHARDED)
    hub_server.add("org/marked", {**files, "sub/": b""})
    hub_server.add("org/odd", {**files, name: b"{}"})
    with pytest.raises(jax_ucp.SourceError, match="an object name the folder cannot hold") as e:
        jax_ucp.restore("hf://org/odd")
    assert repr(name)[1:-1].lstrip("/") in str(e.value)
    assert_same(jax_ucp.restore("hf://org/marked"), jax_ucp.restore(HF_BIN_SHARDED))


def test_a_server_ignoring_range_requests_is_named(repo, hub_server, monkeypatch):
    """The CDN answers every ranged GET with the whole file (HTTP 200, as some mirrors and
    proxies do): a ``SourceError`` naming the file; before: TensorStore's raw ``ValueError``
    ("FAILED_PRECONDITION: Requested byte range [0, 8) was ignored by server")."""
    answer = hub_server._file

    def whole(h, files, name, server, auth):
        if server == "cdn" and name in files:
            return hub_server._send(h, 200, files[name], {})
        return answer(h, files, name, server, auth)

    monkeypatch.setattr(hub_server, "_file", whole)
    with pytest.raises(jax_ucp.SourceError, match=r"-of-00002\.safetensors: .*ignored by server"):
        jax_ucp.restore("hf://org/model")


def test_a_cdn_answering_another_byte_range_is_named(repo, hub_server, monkeypatch):
    """The CDN answers each ranged GET past the first 8 bytes with the range one byte further
    (HTTP 206, its Content-Range saying so): a ``SourceError`` naming the file, the range asked
    and the range answered; before: TensorStore's raw ``ValueError: OUT_OF_RANGE``."""
    import re

    answer = hub_server._file

    def shifted(h, files, name, server, auth):
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", h.headers.get("Range") or "")
        if server == "cdn" and m and int(m[1]) > 0 and name in files:
            data, a, b = files[name], int(m[1]) + 1, int(m[2]) + 1
            content_range = f"bytes {a}-{b}/{len(data)}"
            return hub_server._send(h, 206, data[a : b + 1], {"Content-Range": content_range})
        return answer(h, files, name, server, auth)

    monkeypatch.setattr(hub_server, "_file", shifted)
    with pytest.raises(
        jax_ucp.SourceError,
        match=r"hf://org/model@\w+/model-0000\d-of-00002\.safetensors: bytes \[8, \d+\) asked, "
        r"the server answered bytes \[9, \d+\) of \d+",
    ):
        jax_ucp.restore("hf://org/model")


def test_a_listing_trickled_a_byte_at_a_time_meets_the_requests_deadline(
    repo, hub_server, monkeypatch
):
    """The Hub sends its listing a byte every 50 ms (never a per-read timeout): with a 1 s
    deadline per request (``JAX_UCP_HUB_DEADLINE_S``) the restore stops within about it, with
    ``HubDeadlineError`` naming the API URL; before: held as long as the server trickles (a
    byte every 3 s: forever). An unusable setting is named too."""
    import time

    hub_server.trickle_s = 0.05
    monkeypatch.setenv(hub.DEADLINE_ENV, "1")
    t0 = time.monotonic()
    with pytest.raises(
        hub.HubDeadlineError, match=r"/api/models/org/model/revision/main: \d+ bytes in .*1 s"
    ):
        jax_ucp.restore("hf://org/model")
    assert time.monotonic() - t0 < 10
    monkeypatch.setenv(hub.DEADLINE_ENV, "soon")
    with pytest.raises(jax_ucp.UCPError, match="JAX_UCP_HUB_DEADLINE_S='soon'"):
        jax_ucp.restore("hf://org/model")


def test_a_jax_ucp_checkpoint_in_a_hub_repo_restores_and_verifies(hub_server, tmp_path):
    """A jax_ucp checkpoint pushed to a Hub repo as its files (synthetic): restored exactly and
    verified clean. Before: "shard object …/arrays/b/c/0 is missing (the checkpoint is
    incomplete)": the repo root's kvstore was ``…/resolve/SHA//``, every shard a 404."""
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int8)}
    jax_ucp.save(str(tmp_path / "ck"), tree)
    ck = tmp_path / "ck"
    hub_server.add(
        "org/ucp", {str(f.relative_to(ck)): f.read_bytes() for f in ck.rglob("*") if f.is_file()}
    )
    got = jax_ucp.restore("hf://org/ucp")
    for name, want in tree.items():
        np.testing.assert_array_equal(np.asarray(got[name]), want)
        assert np.asarray(got[name]).dtype == want.dtype
    assert list(jax_ucp.verify("hf://org/ucp")) == []


def test_a_server_failing_every_read_is_retried_a_bounded_number_of_times(
    repo, hub_server, monkeypatch
):
    """The CDN answers every read 503: the restore stops after ``hub.RETRIES`` (here 2) with a
    ``SourceError`` naming the file. Before: TensorStore's own policy, 32 retries up to 32 s
    apart (the probe of issue 56 waited more than 4 minutes for one restore)."""
    monkeypatch.setattr(hub, "RETRIES", {"max_retries": 2, "initial_delay": "10ms"})
    answer, asked = hub_server._file, []

    def failing(h, files, name, server, auth):
        if server == "cdn":
            asked.append(name)
            return hub_server._send(h, 503, b"", {})
        return answer(h, files, name, server, auth)

    monkeypatch.setattr(hub_server, "_file", failing)
    with pytest.raises(jax_ucp.SourceError, match=r"-of-00002\.safetensors: .*2 retry attempts"):
        jax_ucp.restore("hf://org/model")
    assert 0 < len(asked) <= 2 * 2
