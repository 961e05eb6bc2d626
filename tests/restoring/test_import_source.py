"""Restore straight from every real fixture the importers are tested on (``restoring.
import_open`` and ``import_source``): the tree equals convert + restore of the same source with the same options,
value for value, on the host and on a mesh; the import's records come back as convert writes
them; nothing is written. Torch-free: the project's own readers."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import jax_ucp
from jax_ucp._src.format import certificate, to_numpy_dtype
from jax_ucp._src.importers.megatron import legacy as megatron_legacy
from jax_ucp._src.importers.plan import ImportOptions
from jax_ucp._src.restoring import sources
from jax_ucp._src.restoring.sources import import_open
from jax_ucp._src.store import storage_for
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")


def _uncertified(source: dict) -> dict:
    """convert's record without its certificate of the source's files (``source.certificate``),
    which only convert takes: reading a source in place or inspecting it hashes no file."""
    return {k: v for k, v in source.items() if k != certificate.KEY}


def _fixtures():
    """The sources of tests/importers/test_accounting.py's fixtures (the committed ones)."""
    out = sorted(glob.glob(os.path.join(FIXTURES, "deepspeed", "*", "ckpt")))
    out += sorted(glob.glob(os.path.join(FIXTURES, "hf_trainer", "*", "checkpoint-*")))
    out += sorted(
        os.path.dirname(p)
        for pattern in (".metadata", megatron_legacy.TRACKER_FILE)
        for p in glob.glob(os.path.join(FIXTURES, "megatron", "**", pattern), recursive=True)
    )
    out += sorted(
        os.path.dirname(p)
        for p in glob.glob(os.path.join(FIXTURES, "megatron_bridge", "*", "latest_*.pt"))
    )
    out += [
        p
        for p in sorted(glob.glob(os.path.join(FIXTURES, "torch", "*")))
        if not p.endswith((".npz", ".json"))
    ]
    out += sorted(glob.glob(os.path.join(FIXTURES, "accelerate", "*[!z]")))
    out += sorted(
        p for p in glob.glob(os.path.join(FIXTURES, "verl", "*")) if not p.endswith(".npz")
    )
    out += [os.path.join(FIXTURES, "olmo_core", "olmo_fp32")]
    # the default run takes every 8th fixture of each format folder (the first included); the
    # slow stage of CI (-m "torch or slow") takes them all
    seen: dict[str, int] = {}
    params = []
    for p in out:
        if not (os.path.isdir(p) or os.path.isfile(p)):
            continue
        rel = os.path.relpath(p, FIXTURES)
        n = seen[rel.split(os.sep)[0]] = seen.get(rel.split(os.sep)[0], -1) + 1
        params.append(pytest.param(p, id=rel, marks=() if n % 8 == 0 else pytest.mark.slow))
    return params


def _equal(a, b, path="") -> None:
    """The same tree: containers, keys, leaf types, dtypes, shapes, values (NaN equal NaN)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}/{i}")
    elif isinstance(a, (np.ndarray, jax.Array)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        if isinstance(a, jax.Array):
            assert a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    else:
        assert a == b, path


def _both(src, tmp_path, **options):
    """(convert + restore, the direct restore) of ``src``, or the error both give."""
    importing = options.pop("importing", None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"), importing=importing)
    except jax_ucp.UCPError as e:  # refused by the import: the direct restore refuses alike
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(type(e)) as direct:
                jax_ucp.restore(src, importing=importing or ImportOptions(), **options)
        assert str(direct.value) == str(e)
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = jax_ucp.restore(ckpt, **options)
        direct = jax_ucp.restore(src, importing=importing or ImportOptions(), **options)
    return converted, direct, ckpt


def _files(root) -> dict[str, float]:
    return {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime
        for d, _, fs in os.walk(root)
        for f in fs
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("src", _fixtures())
def test_a_direct_restore_equals_convert_then_restore(tmp_path, src):
    before = _files(src)
    got = _both(src, tmp_path)
    assert _files(src) == before  # nothing written beside the source
    if got is None:
        return
    converted, direct, ckpt = got
    _equal(converted, direct)
    assert list(tmp_path.iterdir()) == [tmp_path / "ucp"]  # no scratch copy anywhere else
    # the records as convert writes them in the manifest
    manifest = jax_ucp.inspect(ckpt)
    found = sources.opening(storage_for(src), ImportOptions())
    assert found.importer is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with import_open.opened_import(found.storage, found.importer) as opened:
            assert opened.source == _uncertified(manifest.source)
            assert opened.saved == {
                e.key: (e.shape, to_numpy_dtype(e.dtype)) for e in manifest.tensors
            }


ON_A_MESH = [
    "torch/fsdp2_bf16",  # DCP: Deferred row reads
    "torch/hf_llama_fsdp2",
    "deepspeed/z3_bf16_dp2/ckpt",  # ZeRO-3: flat partitions, built whole
    "deepspeed/z2_fp32_dp3/ckpt",  # mapped views of rank files, read with pread
    "megatron/legacy_gpt_tp2pp2_synthetic",  # merges whose shape is known once built
    "megatron/mcore_versions/0.19.2/gpt_tp2",  # torch_dist
    "torch/plain_state_dict.pt",
]


def _sharded_like(tree, mesh):
    """A target of ``tree``'s arrays on ``mesh``: rows on "a" and columns on "b" where they
    divide (a column cut reads its rows once, cut per device), else replicated."""
    from jax.sharding import PartitionSpec as P

    def one(x):
        if not isinstance(x, np.ndarray) or not x.ndim:
            return x
        spec = [None] * x.ndim
        if x.shape[0] % mesh.shape["a"] == 0:
            spec[0] = "a"
        if x.ndim > 1 and x.shape[-1] % mesh.shape["b"] == 0:
            spec[-1] = "b"
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(*spec)))

    return jax.tree.map(one, tree)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rel", ON_A_MESH)
def test_a_direct_restore_onto_a_mesh_equals_convert_then_restore(tmp_path, rel):
    src = os.path.join(FIXTURES, rel)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"))
        target = _sharded_like(jax_ucp.restore(ckpt), mesh)
    converted, direct, _ = _both(src, tmp_path / "again", target=target)
    _equal(converted, direct)
    assert any(  # some tensor cut on both axes
        isinstance(x, jax.Array)
        and len(x.addressable_shards[0].data.shape) > 1
        and x.addressable_shards[0].data.shape[-1] < x.shape[-1]
        for x in jax.tree.leaves(direct)
    )
    assert _both(src, tmp_path / "bf16", dtype=jnp.bfloat16, casting="unsafe") is not None
    converted, direct, _ = _both(src, tmp_path / "sel", select=r"params/.*")
    _equal(converted, direct)


def test_plan_of_a_source_is_the_plan_of_its_conversion(tmp_path):
    src = os.path.join(FIXTURES, "torch", "hf_llama_fsdp2")
    mesh = jax_ucp.abstract_mesh([("data", 2), ("model", 4)])
    rules = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"))
    with open(os.path.join(FIXTURES, "torch", "hf_llama_fsdp2.config.json")) as f:
        spec = load_spec("hf_llama", **LMConfig.from_hf_llama(json.load(f)).head_settings)

    def rows(p):
        return [
            (t.name, t.shape, t.dtype, t.partition_spec, t.bytes_per_device, dict(t.read_bytes))
            for t in p.tensors
        ]

    converted = jax_ucp.plan(ckpt, mesh=mesh, rules=rules, spec=spec, processes=2)
    direct = jax_ucp.plan(src, mesh=mesh, rules=rules, spec=spec, processes=2)
    assert rows(direct) == rows(converted) and len(rows(direct)) > 10
    assert (direct.values, dict(direct.device_bytes)) == (
        converted.values,
        dict(converted.device_bytes),
    )


def test_ucp_restore_reads_a_torch_source_through_orbax_args(tmp_path):
    src = os.path.join(FIXTURES, "torch", "fsdp2_fp32")
    handler = jax_ucp.UCPCheckpointHandler()
    got = handler.restore(src, args=jax_ucp.UCPRestore(importing=ImportOptions(weights_only=True)))
    want = jax_ucp.restore(
        jax_ucp.convert(src, str(tmp_path / "ucp"), importing=ImportOptions(weights_only=True))
    )
    _equal(want, got)
    assert set(got) == {"params"}


def test_import_options_given_for_a_ucp_checkpoint_are_refused(tmp_path):
    ckpt = jax_ucp.save(tmp_path / "ucp", {"w": np.ones(3, np.float32)})
    with pytest.raises(jax_ucp.RequestError, match=r"importing= and format= apply to the sources"):
        jax_ucp.restore(ckpt, importing=ImportOptions(weights_only=True))
    with pytest.raises(jax_ucp.RequestError, match=r"format"):
        jax_ucp.RestoreOptions(format=3)


def test_a_folder_no_importer_claims_is_still_no_jax_ucp_checkpoint(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    with pytest.raises(jax_ucp.CheckpointError, match="not a jax_ucp checkpoint"):
        jax_ucp.restore(tmp_path / "x")
    with pytest.raises(jax_ucp.SourceError, match="cannot tell the checkpoint format"):
        jax_ucp.restore(tmp_path / "x", importing=ImportOptions())


def test_a_flipped_byte_in_a_torch_file_is_an_error_naming_it(tmp_path):
    """torch.save's zip records each storage's CRC-32: a byte changed in a tensor's bytes is
    an error naming the file, never a silently different value."""
    src = tmp_path / "model.pt"
    data = bytearray(open(os.path.join(FIXTURES, "torch", "plain_state_dict.pt"), "rb").read())
    good = jax_ucp.restore(os.path.join(FIXTURES, "torch", "plain_state_dict.pt"))
    leaf = next(iter(good["params"].values()))
    needle = np.ascontiguousarray(leaf).tobytes()[:16]
    at = bytes(data).find(needle)
    assert at > 0
    data[at + 3] ^= 0x10
    src.write_bytes(bytes(data))
    with pytest.raises(jax_ucp.UCPError, match=r"model\.pt.*CRC|CRC.*model\.pt"):
        jax_ucp.restore(src)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "rel",
    [
        "hf_trainer/trainer_fp32/checkpoint-3",
        "hf_trainer/trainer_lora/checkpoint-3",
        "deepspeed/z0_fp32_dp2/ckpt",
        "torch/accelerate_save_state",
        "megatron/gpt_distopt_dp2",
    ],
)
def test_weights_only_reads_as_convert_weights_only(tmp_path, rel):
    """Sources refused whole without transformers (the Trainer's parameter order), peft or a
    ZeRO-0 optimizer: their weights alone, as ``convert(weights_only=True)``."""
    src = os.path.join(FIXTURES, rel)
    got = _both(src, tmp_path, importing=ImportOptions(weights_only=True))
    assert got is not None
    converted, direct, ckpt = got
    _equal(converted, direct)
    assert "opt_state" not in direct
    weights = ImportOptions(weights_only=True)
    found = sources.opening(storage_for(src), weights)
    assert found.importer is not None
    with import_open.opened_import(found.storage, found.importer, weights) as opened:
        assert opened.source == _uncertified(jax_ucp.inspect(ckpt).source)  # skipped listed


@pytest.mark.parametrize(
    "rel",
    ["torch/fsdp2_bf16", "deepspeed/z3_bf16_dp2/ckpt", "megatron/legacy_gpt_tp2pp2_synthetic"],
)
def test_inspect_of_a_source_is_the_manifest_convert_writes(tmp_path, rel):
    src = os.path.join(FIXTURES, rel)
    direct = jax_ucp.inspect(src)
    converted = jax_ucp.inspect(jax_ucp.convert(src, str(tmp_path / "ucp")))
    assert direct.source == _uncertified(converted.source)
    assert len(direct.tensors) == len(converted.tensors) > 5
    for a, b in zip(direct.tensors, converted.tensors):
        assert msgspec.structs.replace(a, shard_digests=None) == msgspec.structs.replace(
            b, shard_digests=None
        )
    assert direct.values == converted.values
    assert list(tmp_path.iterdir()) == [tmp_path / "ucp"]


@pytest.mark.parametrize("cut", [8, 4096])
def test_a_truncated_rank_file_is_an_error_naming_it(tmp_path, cut):
    """A DCP rank file cut short (a copy that did not finish): an error naming the file, at
    open or as the bytes are read, never a short or zero-filled tensor."""
    import shutil

    src = tmp_path / "dcp"
    shutil.copytree(os.path.join(FIXTURES, "torch", "fsdp2_fp32"), src)
    rank = src / "__1_0.distcp"
    rank.write_bytes(rank.read_bytes()[:-cut])
    with pytest.raises(jax_ucp.UCPError, match=r"__1_0\.distcp"):
        jax_ucp.restore(src, importing=ImportOptions())


def test_a_spec_restore_of_a_torch_source_onto_a_mesh_equals_convert_then_restore(tmp_path):
    """``hf_llama``'s transforms (q/k/v merged, kernels transposed) as lazy views over the
    import's tensors (torch DCP rows), placed by logical-axis rules."""
    src = os.path.join(FIXTURES, "torch", "hf_llama_fsdp2")
    with open(os.path.join(FIXTURES, "torch", "hf_llama_fsdp2.config.json")) as f:
        spec = load_spec("hf_llama", **LMConfig.from_hf_llama(json.load(f)).head_settings)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rules = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]
    converted, direct, _ = _both(src, tmp_path, spec=spec, mesh=mesh, rules=rules)
    _equal(converted, direct)
    assert (
        sum(isinstance(x, jax.Array) and not x.is_fully_replicated for x in jax.tree.leaves(direct))
        > 5
    )


@pytest.mark.parametrize(
    "name",
    [
        "gpt_distopt_dp2",
        "llama_distopt_bf16_tp2dp2",
        "llama_tp2",
        "mcore_versions/0.13.1/gpt_distopt_fully_sharded_model_space",  # flattened states
    ],
)
def test_opening_a_torch_dist_source_reads_no_tensor_bytes(name, monkeypatch):
    """What a direct restore opens first (``inspect`` does only that) reads the metadata, never
    a tensor: the torch_dist import's tensors are read when the consumer has room, in row slabs
    (they were all read when the source was opened: a direct restore of a 1 GB source peaked at
    twice its tensors, 2.0 GiB)."""
    read: list[str] = []
    preadv, pread = os.preadv, os.pread

    def counting_preadv(fd, buffers, offset, *a):
        read.append(os.readlink(f"/proc/self/fd/{fd}"))
        return preadv(fd, buffers, offset, *a)

    def counting_pread(fd, n, offset):
        read.append(os.readlink(f"/proc/self/fd/{fd}"))
        return pread(fd, n, offset)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    monkeypatch.setattr(os, "pread", counting_pread)
    path = os.path.join(FIXTURES, "megatron", name)
    manifest = jax_ucp.inspect(path)
    assert manifest.tensors
    assert not [p for p in read if p.endswith(".distcp")]
    tree = jax_ucp.restore(path, importing=ImportOptions())  # and the reads happen then
    assert [p for p in read if p.endswith(".distcp")]
    assert len(jax.tree.leaves(tree)) >= len(manifest.tensors)


def test_a_trainer_checkpoint_is_detected_once_per_restore(monkeypatch):
    """A Trainer ``checkpoint-N/`` (safetensors weights beside ``optimizer.pt``) is claimed by
    safetensors and taken over by ``hf_trainer``: its detector is asked once per restore (the
    importer detected is handed down to the plan), whole or weights only, and once per
    ``plan_import`` (convert's)."""
    from jax_ucp._src.importers import registry
    from jax_ucp._src.importers.torch import TorchOptions

    src = os.path.join(FIXTURES, "hf_trainer", "trainer_fp32", "checkpoint-3")
    with np.load(os.path.join(FIXTURES, "hf_trainer", "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    order = [n for n in names if not n.endswith("norm.weight")]
    order += [n for n in names if n.endswith("norm.weight")]  # as the Trainer grouped them
    taker = registry.IMPORTERS["hf_trainer"]
    asked = []

    def detect(storage):
        asked.append(storage.root)
        return taker.detect(storage)

    monkeypatch.setitem(registry.IMPORTERS, "hf_trainer", dataclasses.replace(taker, detect=detect))
    whole = jax_ucp.restore(src, importing=TorchOptions(parameter_order=order))
    assert asked == [src] and "opt_state" in whole
    weights = jax_ucp.restore(src, importing=TorchOptions(weights_only=True))
    assert asked == [src] * 2 and "opt_state" not in weights
    assert registry.plan_import(src, TorchOptions(parameter_order=order)).source["optimizer"]
    assert asked == [src] * 3


def _detections(monkeypatch) -> list[tuple[str, str]]:
    """``(importer, path)`` of each entry into a detector of ``registry.IMPORTERS``, from now."""
    from jax_ucp._src.importers import registry

    asked: list[tuple[str, str]] = []
    for name, importer in list(registry.IMPORTERS.items()):

        def detect(storage, name=name, detector=importer.detect):
            asked.append((name, storage.root))
            return detector(storage)

        monkeypatch.setitem(registry.IMPORTERS, name, dataclasses.replace(importer, detect=detect))
    return asked


def test_optax_from_torch_and_verify_enter_each_detector_once(tmp_path, monkeypatch):
    """``optax_from_torch`` and ``verify`` of a source (and ``verify(against=)``'s planning of
    it again) detect its importer once and hand it down, as a restore does: every detector is
    entered once per call (hf_trainer's, which takes safetensors' claim over, included)."""
    from safetensors.numpy import save_file

    from jax_ucp._src.importers import registry
    from jax_ucp._src.importers.torch import TorchOptions

    src = os.path.join(FIXTURES, "hf_trainer", "trainer_fp32", "checkpoint-3")
    with np.load(os.path.join(FIXTURES, "hf_trainer", "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    order = [n for n in names if not n.endswith("norm.weight")]
    order += [n for n in names if n.endswith("norm.weight")]  # as the Trainer grouped them
    asked = _detections(monkeypatch)
    once = sorted((name, src) for name in registry.IMPORTERS)
    importing = TorchOptions(parameter_order=order)
    run = jax_ucp.optax_from_torch(src, options=jax_ucp.RestoreOptions(importing=importing))
    assert sorted(asked) == once and run.step == 3
    asked.clear()
    verified = jax_ucp.verify(src)
    assert sorted(asked) == once
    if importlib.util.find_spec("transformers") is not None:  # the Trainer's order rebuilt
        assert list(verified) == []
        assert verified.source is not None and verified.source.tensors > 0
    else:  # without transformers the order is not known: said, naming the option
        assert len(verified) == 1 and "--parameter-order" in str(next(iter(verified)))
    weights = tmp_path / "model.safetensors"
    save_file({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(weights))
    ckpt = jax_ucp.convert(weights, tmp_path / "ucp")
    asked.clear()
    assert jax_ucp.verify(ckpt, against=weights) == []
    assert sorted(asked) == sorted((name, str(weights)) for name in registry.IMPORTERS)


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_verify_logits_against_a_source_enters_each_detector_once(tmp_path, monkeypatch):
    """``verify(against=, logits=True)`` of a torch DCP folder: the weights transformers' model
    is given are read by the import the tensors were compared by (planned once)."""
    from jax_ucp._src.importers import registry

    src = shutil.copytree(os.path.join(FIXTURES, "torch", "hf_llama_fsdp2"), tmp_path / "src")
    shutil.copy(os.path.join(FIXTURES, "torch", "hf_llama_fsdp2.config.json"), src / "config.json")
    ckpt = jax_ucp.convert(src, tmp_path / "ucp")
    asked = _detections(monkeypatch)
    found = jax_ucp.verify(ckpt, against=src, logits=True)
    assert list(found) == [] and found.logits is not None and found.logits.ok
    assert sorted(asked) == sorted((name, str(src)) for name in registry.IMPORTERS)


@pytest.fixture
def trainer_run_root(tmp_path):
    """A Trainer ``output_dir``: ``checkpoint-2`` complete, ``checkpoint-4`` a save that died
    before the Trainer wrote its ``trainer_state.json``."""
    step = os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2")
    root = tmp_path / "out"
    shutil.copytree(step, root / "checkpoint-2")
    shutil.copytree(step, root / "checkpoint-4")
    os.remove(root / "checkpoint-4" / "trainer_state.json")
    return str(root)


def test_a_run_root_enters_each_detector_once(trainer_run_root, monkeypatch):
    """A restore of a Trainer ``output_dir`` asks every detector once of the root (none claims
    it: a run root of checkpoints, what detection says) and once of the newest complete step it
    reads; the root is not asked again to tell a run root from a damaged format file."""
    from jax_ucp._src.importers import registry

    asked = _detections(monkeypatch)
    with pytest.warns(jax_ucp.ResumeWarning, match="checkpoint-4"):
        tree = jax_ucp.restore(trainer_run_root)
    step = os.path.join(trainer_run_root, "checkpoint-2")
    assert sorted(asked) == sorted(
        (name, p) for name in registry.IMPORTERS for p in (trainer_run_root, step)
    )
    assert "opt_state" in tree


def test_a_run_root_whose_format_file_is_damaged_is_not_passed_over(trainer_run_root, monkeypatch):
    """A run root whose own format file a detector cannot read (simulated: the detector raises
    the error its format gives), or that holds two formats' files: the error is raised as it
    is, its newest step is not read instead."""
    from jax_ucp._src.errors import SourceError
    from jax_ucp._src.importers import registry

    dcp = registry.IMPORTERS["torch_dcp"]

    def damaged(storage):
        if storage.root == trainer_run_root:
            raise SourceError(f"{storage.root}/.metadata: corrupt pickle (simulated)")
        return dcp.detect(storage)

    monkeypatch.setitem(registry.IMPORTERS, "torch_dcp", dataclasses.replace(dcp, detect=damaged))
    with pytest.raises(SourceError, match=r"\.metadata: corrupt pickle"):
        jax_ucp.restore(trainer_run_root)
    monkeypatch.undo()
    shutil.copytree(
        os.path.join(FIXTURES, "torch", "fsdp2_fp32"), trainer_run_root, dirs_exist_ok=True
    )
    shutil.copytree(
        os.path.join(FIXTURES, "deepspeed", "z0_fp32_dp2", "ckpt"),
        trainer_run_root,
        dirs_exist_ok=True,
    )
    with pytest.raises(SourceError, match=r"2 formats: torch .*; deepspeed "):
        jax_ucp.restore(trainer_run_root)
