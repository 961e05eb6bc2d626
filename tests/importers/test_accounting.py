"""Every import accounts for every source tensor: the checkpoint's tensors (read here, by the
test, with the project's torch-free readers) = the tensors the output names in its provenance
(``provenance["tensors"]``) + ``source.skipped`` (name -> reason), and no optimizer buffer ever
lands under ``params/`` or ``model_params/``. Over every fixture of every importer, with and
without ``weights_only``; plus the pipeline's refusals (docs/FORMAT.md, section 2.2.1)."""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from collections.abc import Mapping

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.format import safetensors as safetensors_hf
from jax_ucp._src.importers import plan as plan_lib
from jax_ucp._src.importers.deepspeed import files as deepspeed_files
from jax_ucp._src.importers.deepspeed import zero as deepspeed_zero
from jax_ucp._src.importers.megatron import dcp as megatron_dcp
from jax_ucp._src.importers.megatron import legacy as megatron_legacy
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles import dcp as torch_dcp
from jax_ucp._src.torchfiles import dcp_safetensors
from jax_ucp._src.torchfiles.torch_zip import load_torch_file
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")

# Names of optimizer state: never a model weight's (checked on output keys under params/).
OPTIMIZER_WORDS = re.compile(
    r"exp_avg|optimizer|fp32_from|param_state|bucket|gbuf|momentum_buffer|dp_group_idx"
)


def _walk(obj, prefix=""):
    """Dotted paths of the arrays of a loaded state dict (the test's own walk)."""
    if isinstance(obj, np.ndarray):
        yield prefix
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}.{i}" if prefix else str(i))


def _deepspeed_tensors(src: str) -> set[str]:
    """``<file>:<path>`` of every array in every .pt file of the tag ``latest`` names."""
    with open(os.path.join(src, "latest")) as f:
        tag_dir = os.path.join(src, f.read().strip())
    return {
        f"{os.path.basename(path)}:{name}"
        for path in sorted(glob.glob(os.path.join(tag_dir, "*.pt")))
        for name in _walk(
            deepspeed_files.load_deepspeed_file(LocalDirectory(tag_dir), os.path.basename(path))
        )
    }


def _megatron_tensors(src: str) -> set[str]:
    """torch_dist: the ``.metadata`` tensor keys; legacy: ``<rank dir>/<file>:<path>``."""
    if os.path.exists(os.path.join(src, ".metadata")):
        return set(megatron_dcp.open_dcp(LocalDirectory(str(src))).tensors)
    with open(os.path.join(src, megatron_legacy.TRACKER_FILE)) as f:
        iteration = f.read().strip()
    iter_dir = os.path.join(src, f"iter_{int(iteration):07d}")
    if os.path.exists(os.path.join(iter_dir, ".metadata")):  # Megatron Bridge: torch_dist
        return set(megatron_dcp.open_dcp(LocalDirectory(str(iter_dir))).tensors)
    return {
        f"{os.path.relpath(path, iter_dir)}:{name}"
        for path in sorted(glob.glob(os.path.join(iter_dir, "mp_rank_*", "*.pt")))
        for name in _walk(load_torch_file(path, megatron_legacy.LEGACY_CLASSES))
    }


def _safetensors_tensors(src: str) -> set[str]:
    """The header keys of every .safetensors file (``__metadata__`` aside), and a Trainer's
    ``optimizer.pt`` as one unit (it is never opened)."""
    paths = [src] if os.path.isfile(src) else glob.glob(os.path.join(src, "*.safetensors"))
    names = set()
    for path in paths:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names |= set(json.loads(f.read(size))) - {"__metadata__"}
    for unit in ("optimizer.pt", "optimizer.bin"):  # the Trainer's; Accelerate's save_state
        if os.path.isdir(src) and os.path.exists(os.path.join(src, unit)):
            names.add(unit)
    return names


def _torch_tensors(src: str) -> set[str]:
    """DCP: every ``.metadata`` entry (tensors and pickled objects) of the folder, or of each
    Accelerate sub-folder holding one; torch.save: ``<file>:<path>`` of every array of every
    ``.bin`` / ``.pt`` / ``.ckpt`` file."""
    if os.path.isdir(src):
        dirs = [src] if os.path.exists(os.path.join(src, ".metadata")) else []
        dirs = dirs or sorted(os.path.dirname(p) for p in glob.glob(f"{src}/*/.metadata"))
        names: set[str] = set()
        if dcp_safetensors.is_rank_local(src):  # torch's HF writer, rank-local (+ optimizer/)
            names |= set(dcp_safetensors.open_rank_local(src).tensors)
        elif glob.glob(f"{src}/*.safetensors"):  # torch's HF writer, one process: plain files
            names |= _safetensors_tensors(src)
        if dirs or names:
            for d in dirs:
                ck = torch_dcp.open_dcp(d)
                names |= set(ck.tensors) | set(ck.objects)
            # a Trainer FSDP checkpoint's RNG states, skipped as whole files
            return names | {os.path.basename(p) for p in glob.glob(f"{src}/rng_state*.pth")}
    paths = [src] if os.path.isfile(src) else glob.glob(os.path.join(src, "*"))
    return {
        f"{os.path.basename(path)}:{name}"
        for path in sorted(paths)
        if path.endswith((".bin", ".pt", ".ckpt", ".pth"))
        for name in _walk(load_torch_file(path))
    }


def _fixtures():
    out = []
    for path in sorted(glob.glob(os.path.join(FIXTURES, "deepspeed", "*", "ckpt"))):
        out.append(pytest.param("deepspeed", path, id=os.path.relpath(path, FIXTURES)))
    for path in sorted(glob.glob(os.path.join(FIXTURES, "hf_trainer", "*", "checkpoint-*"))):
        # with DeepSpeed (``latest``), or the Trainer's own optimizer.pt beside model.safetensors
        # or the FSDP layout's DCP folders (pytorch_model_fsdp_0/, optimizer_0/)
        kind = "deepspeed" if os.path.exists(os.path.join(path, "latest")) else "trainer"
        kind = "torch" if glob.glob(os.path.join(path, "*", ".metadata")) else kind
        out.append(pytest.param(kind, path, id=os.path.relpath(path, FIXTURES)))
    megatron = sorted(
        os.path.dirname(p)
        for pattern in (".metadata", megatron_legacy.TRACKER_FILE)
        for p in glob.glob(os.path.join(FIXTURES, "megatron", "**", pattern), recursive=True)
    )
    for path in megatron:
        rel = os.path.relpath(path, FIXTURES)
        out.append(pytest.param("megatron", path, id=rel))
    for path in sorted(glob.glob(os.path.join(FIXTURES, "megatron_bridge", "*", "latest_*.pt"))):
        path = os.path.dirname(path)  # a Megatron Bridge save directory
        out.append(pytest.param("megatron", path, id=os.path.relpath(path, FIXTURES)))
    for path in sorted(glob.glob(os.path.join(FIXTURES, "torch", "*"))):
        if os.path.exists(os.path.join(path, "model.safetensors")):  # Accelerate's save_state
            out.append(pytest.param("safetensors", path, id=os.path.relpath(path, FIXTURES)))
        elif not path.endswith((".npz", ".json")):
            out.append(pytest.param("torch", path, id=os.path.relpath(path, FIXTURES)))
    for kind in ("single", "sharded", "trainer"):
        out.append(pytest.param("safetensors", kind, id=f"safetensors-{kind}"))
    return out


def _build_safetensors(kind: str, tmp_path) -> str:
    """A single file, a folder of shards with its index, or a Trainer folder with optimizer.pt."""
    from safetensors.numpy import save_file

    folder = tmp_path / f"st_{kind}"
    folder.mkdir()
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float16)}
    b = {"layers.0.norm.weight": np.full(4, 2, np.float32)}
    if kind == "single":
        save_file(a, str(folder / "model.safetensors"))
        return str(folder / "model.safetensors")
    save_file(a, str(folder / "model-00001-of-00002.safetensors"))
    save_file(b, str(folder / "model-00002-of-00002.safetensors"))
    if kind == "trainer":
        (folder / "optimizer.pt").write_bytes(b"never read")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in a}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in b})
    (folder / safetensors_hf.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


# ZeRO-0 optimizer state is refused (the weights alone are imported with weights_only=True)
REFUSED = {
    ("z0_fp32_dp2", False): r"ZeRO stage 0 checkpoint.*--weights-only",
    # torch's own dcp.load cannot read it either (tests/importers/torch/test_dcp_formats.py)
    ("dcp_safetensors_format", False): r"serialization_format=SAFETENSORS",
    ("dcp_safetensors_format", True): r"serialization_format=SAFETENSORS",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights_only", [False, True], ids=["full", "weights_only"])
@pytest.mark.parametrize("importer, src", _fixtures())
def test_every_source_tensor_is_imported_or_skipped(tmp_path, importer, src, weights_only):
    if importer == "safetensors" and not os.path.isabs(src):
        if src == "trainer" and not weights_only:
            pytest.skip("refused without weights_only (tests/importers/safetensors/test_import.py)")
        src = _build_safetensors(src, tmp_path)
    elif importer == "safetensors" and not weights_only:
        pytest.skip(
            "optimizer.bin refused without weights_only (tests/importers/torch/test_files.py)"
        )
    elif importer == "trainer" and not weights_only:
        pytest.skip(
            "optimizer.pt mapped with transformers (tests/importers/torch/test_hf_trainer.py)"
        )
    refused = REFUSED.get((os.path.basename(os.path.dirname(src)), weights_only)) or REFUSED.get(
        (os.path.basename(src), weights_only)
    )
    if refused:
        with pytest.raises(jax_ucp.UCPError, match=refused):
            jax_ucp.convert(
                src, str(tmp_path / "u"), importing=ImportOptions(weights_only=weights_only)
            )
        assert not (tmp_path / "u").exists()
        return
    found = {
        "deepspeed": _deepspeed_tensors,
        "megatron": _megatron_tensors,
        "safetensors": _safetensors_tensors,
        "trainer": _safetensors_tensors,  # weights_only: safetensors + optimizer.pt as a unit
        "torch": _torch_tensors,
    }[importer](src)
    manifest = jax_ucp.inspect(
        jax_ucp.convert(
            src, str(tmp_path / "u"), importing=ImportOptions(weights_only=weights_only)
        )
    )
    weights = [e for e in manifest.tensors if e.key[0] in ("params", "model_params")]
    named_like_optimizer = [e.key for e in weights if OPTIMIZER_WORDS.search("/".join(e.key[1:]))]
    assert named_like_optimizer == []
    moments_as_weights = [
        e.key
        for e in weights
        for t in (e.provenance or {}).get("tensors", [])
        if re.search(r"exp_avg|exp_avg_sq|momentum", t)
    ]
    assert moments_as_weights == []
    if weights_only:
        assert not [e.key for e in manifest.entries if e.key[0] == "opt_state"]
    imported = {t for e in manifest.tensors for t in (e.provenance or {}).get("tensors", [])}
    skipped = manifest.source.get("skipped", {})
    assert all(isinstance(why, str) and why for why in skipped.values())
    assert imported & set(skipped) == set()
    assert imported | set(skipped) == found


@pytest.mark.timeout(60)
def test_an_importer_dropping_a_moment_commits_nothing(tmp_path, monkeypatch):
    """The class of bug the rule exists for: an importer that forgets a state (here ZeRO's
    exp_avg_sq, i.e. Adam's nu) would exit 0 with half the optimizer; the pipeline refuses to
    commit, naming the tensors nobody imported."""
    monkeypatch.setattr(deepspeed_zero, "STATE_TREES", deepspeed_zero.STATE_TREES[:2])
    src = os.path.join(FIXTURES, "deepspeed", "z2_fp32_dp2", "ckpt")
    with pytest.raises(
        SourceError,
        match=r"2 of the checkpoint's \d+ tensors have no place in the import and no reason "
        r"to be left out: 'zero_pp_rank_0_mp_rank_00_optim_states\.pt:optimizer_state_dict\."
        r"base_optimizer_state\.state\.0\.exp_avg_sq'.*Nothing was committed",
    ):
        jax_ucp.convert(src, str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()


@pytest.mark.timeout(60)
def test_optimizer_state_under_params_is_refused(tmp_path):
    """A tensor named like optimizer state never lands under params/ (here a safetensors file
    holding a moment under a torch_dist-style key)."""
    from safetensors.numpy import save_file

    path = str(tmp_path / "model.safetensors")
    save_file({"w": np.ones(3, np.float32), "optimizer.state.exp_avg.w": np.ones(3)}, path)
    with pytest.raises(
        SourceError,
        match=r"output tensor 'params/optimizer\.state\.exp_avg\.w' is named like optimizer "
        r"state, not a model weight; refusing to write it under 'params'",
    ):
        jax_ucp.convert(path, str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()


def _plan(items, found, skipped=None):
    source = {"skipped": skipped} if skipped is not None else {}
    return plan_lib.ImportPlan(iter(items), source, len(items), source_tensors=found)


def _item(key, *tensors):
    return plan_lib.host_item(key, np.zeros(2, np.float32), {"tensors": list(tensors)})


@pytest.mark.timeout(10)
def test_accounting_refuses_bookkeeping_that_does_not_add_up():
    """Each item names tensors the importer found; source.skipped lists only found tensors,
    each with a reason; an item naming nothing is refused."""
    ok = _plan([_item(("params", "a"), "a")], ["a", "b"], {"b": "not a weight"})
    assert [i.key for i in plan_lib.accounted(ok, "src")] == [("params", "a")]
    # built from no tensor (a step read from pickled param_groups): names the values instead
    step = plan_lib.host_item(("opt_state", "count"), np.int32(2), {"values": ["common.pt:x"]})
    assert list(plan_lib.accounted(_plan([step], []), "src")) == [step]
    cases = [
        (
            _plan([_item(("params", "a"), "a", "z")], ["a"]),
            r"built from 'z', which are not among the checkpoint's",
        ),
        (
            _plan([_item(("params", "a"))], ["a"]),
            r"cannot say which entries of the checkpoint 'params/a' would be built from",
        ),
        (_plan([_item(("params", "a"), "a")], ["a"], {"y": "r"}), r"skipped lists 'y'"),
        (_plan([_item(("params", "a"), "a")], ["a", "b"], {"b": ""}), r"skipped lists 'b'"),
        (_plan([], ["a"]), r"1 of the checkpoint's 1 tensors .*: 'a'"),
        (_plan([_item(("params", "a"), "a")], ["a"], {"a": "r"}), r"also lists as not imported"),
    ]
    for plan, message in cases:
        with pytest.raises(SourceError, match=message):
            list(plan_lib.accounted(plan, "src"))
    # one process's share of a shared import: the others import the rest
    assert list(plan_lib.accounted(_plan([], ["a"]), "src", whole=False)) == []
