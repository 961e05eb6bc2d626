"""DeepSpeed importer on real checkpoints written by DeepSpeed: equal to DeepSpeed's own tools.

References (committed with the fixtures, made by tools/fixtures/make_deepspeed_fixtures.py):
``ref_universal.npz`` from ``ds_to_universal --inject_missing_state`` and ``ref_zero_to_fp32.npz``
from ``deepspeed.utils.zero_to_fp32``. No torch needed here.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.deepspeed import detect, open_deepspeed_checkpoint
from jax_ucp._src.importers.deepspeed import files as deepspeed_files
from jax_ucp._src.importers.deepspeed.zero import optimizer_step
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles import pickle_format, torch_zip
from jax_ucp._src.torchfiles.allow_list import StandIn, TorchFileError
from jax_ucp.conversion import MegatronOptions, convert
from jax_ucp.errors import SourceError
from tests.ucp_testing import (
    FIXTURES,
    REPO,
    assert_bit_exact,
    assert_convert_refused,
    assert_destination_untouched,
    copy_deepspeed_fixture,
    copy_fixture,
    move_out,
    restored_params,
)

FIX = os.path.join(REPO, "tests", "fixtures", "deepspeed")
# the stage x dtype x DP grid (frozen-parameter and ZeRO-0 runs: tests/importers/test_reach.py)
REAL = sorted(
    os.path.basename(d)
    for d in glob.glob(os.path.join(FIX, "z[123]_*"))
    if "synthetic" not in d and not d.endswith("_frozen")
)
SYNTH = sorted(os.path.basename(d) for d in glob.glob(os.path.join(FIX, "*synthetic*")))


def test_fixture_matrix_is_complete():
    # every stage x {fp32, bf16} x DP {2, 3}, all real
    assert (
        sorted(f"z{s}_{d}_dp{w}" for s in (1, 2, 3) for d in ("bf16", "fp32") for w in (2, 3))
        == REAL
    )
    for name in REAL:
        run = json.load(open(os.path.join(FIX, name, "run.json")))
        assert run["n_params"] % run["world"] != 0, (
            f"{name}: parameter count divides the world size"
        )


_converted: dict[str, str] = {}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    def get(name: str) -> str:
        if name not in _converted:
            out = tmp_path_factory.mktemp("ucp") / name
            _converted[name] = convert(os.path.join(FIX, name, "ckpt"), out, format="deepspeed")
        return _converted[name]

    return get


@pytest.mark.parametrize("name", REAL + SYNTH)
def test_equals_ds_to_universal_and_zero_to_fp32(converted, name):
    d = os.path.join(FIX, name)
    run = json.load(open(os.path.join(d, "run.json")))
    got = jax_ucp.restore(converted(name))
    U = np.load(os.path.join(d, "ref_universal.npz"))
    Z = np.load(os.path.join(d, "ref_zero_to_fp32.npz"))
    names = sorted({k.rsplit("/", 1)[0] for k in U.files})
    assert sorted(got["params"]) == names == sorted(Z.files)
    assert sorted(got["opt_state"]["mu"]) == names == sorted(got["opt_state"]["nu"])
    for n in names:
        shape = Z[n].shape  # the parameter's real shape (ds_to_universal's stage 3 output is flat)
        for state, tree in (
            ("fp32", got["params"]),
            ("exp_avg", got["opt_state"]["mu"]),
            ("exp_avg_sq", got["opt_state"]["nu"]),
        ):
            ref = U[f"{n}/{state}"]
            if run["stage"] == 3:
                assert ref.ndim == 1
            ref = ref.reshape(shape)
            assert tree[n].shape == shape and tree[n].dtype == np.float32, (n, state)
            np.testing.assert_array_equal(tree[n], ref, err_msg=f"{name} {n} {state}")
        np.testing.assert_array_equal(got["params"][n], Z[n], err_msg=f"{name} {n} zero_to_fp32")
        if f"{n}/step" in U.files:
            assert int(U[f"{n}/step"]) == int(got["opt_state"]["count"])
    count = got["opt_state"]["count"]
    assert np.asarray(count).dtype == np.int32 and int(count) == run["steps"]
    lowp = run["dtype"] != "fp32"
    assert ("model_params" in got) == lowp
    if lowp:
        want = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}[run["dtype"]]
        for n in names:
            m = got["model_params"][n]
            assert m.dtype == want and m.shape == Z[n].shape
            # model weights are DeepSpeed's low-precision copy of the fp32 master
            np.testing.assert_allclose(m.astype(np.float32), Z[n], rtol=2**-7, atol=1e-6)


def test_bf16_model_params_are_the_stored_module_weights(converted):
    """Stage 1/2 store the bf16 module; it must come through bit for bit (not re-cast)."""
    from jax_ucp._src.importers.deepspeed import DS_CLASSES
    from jax_ucp._src.torchfiles.torch_zip import load_torch_file

    name = "z2_bf16_dp3"
    ms = load_torch_file(
        os.path.join(FIX, name, "ckpt", "global_step2", "mp_rank_00_model_states.pt"), DS_CLASSES
    )
    got = jax_ucp.restore(converted(name))
    for n, v in ms["module"].items():
        assert np.array_equal(got["model_params"][n].view(np.uint16), v.view(np.uint16)), n


def test_tag_folder_latest_and_manager_step(tmp_path):
    src = os.path.join(FIX, "z2_fp32_dp3", "ckpt")
    assert detect(LocalDirectory(src)).found
    assert detect(LocalDirectory(os.path.join(src, "global_step2"))).found
    assert not detect(LocalDirectory(str(tmp_path))).found
    seen = []
    a = convert(
        os.path.join(src, "global_step2"),
        tmp_path / "a",
        format="deepspeed",
        progress=lambda *x: seen.append(x),
    )
    assert len(seen) == 30 and seen[-1][1:] == (30, 30)
    b = convert(src, tmp_path / "mgr", format="deepspeed", step=2)
    assert b == os.path.join(str(tmp_path / "mgr"), "2", "state")
    ra, rb = jax_ucp.restore(a), jax_ucp.restore(os.path.join(tmp_path / "mgr", "2"))
    for n in ra["params"]:
        np.testing.assert_array_equal(ra["params"][n], rb["params"][n])
    m = jax_ucp.inspect(a)
    assert m.source["framework"] == "deepspeed" and m.source["zero_stage"] == 2


def test_a_tag_folder_renamed_to_another_step_says_so(tmp_path):
    """``global_step2/`` renamed ``global_step5/`` (``latest`` following): the model states'
    global_steps 2 is recorded and a warning names both; before: nothing said. Under its own
    name nothing is warned."""
    src = copy_deepspeed_fixture(tmp_path, "z1_fp32_dp2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        convert(src, tmp_path / "intact", format="deepspeed")
    assert not [w for w in seen if "tag folder's name" in str(w.message)]
    os.rename(os.path.join(src, "global_step2"), os.path.join(src, "global_step5"))
    with open(os.path.join(src, "latest"), "w") as f:
        f.write("global_step5")
    with pytest.warns(UserWarning, match=r"global_step5: the tag folder's name says step 5, its "):
        out = convert(src, tmp_path / "out", format="deepspeed")
    assert jax_ucp.inspect(out).source["global_steps"] == 2


def test_existing_destination_refused_unless_force(tmp_path):
    src = os.path.join(FIX, "z1_fp32_dp2", "ckpt")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(jax_ucp.SaveConflictError):
        convert(src, dst, format="deepspeed")
    assert (dst / "keep.txt").read_text() == "x"
    # force replaces a checkpoint, never a folder of the user's
    with pytest.raises(OSError, match="refusing to replace it even with force=True"):
        convert(src, dst, format="deepspeed", force=True)
    assert (dst / "keep.txt").read_text() == "x"
    old = convert(os.path.join(FIX, "z2_fp32_dp2", "ckpt"), tmp_path / "old", format="deepspeed")
    convert(src, old, format="deepspeed", force=True)
    assert jax_ucp.inspect(old).source["path"].startswith(os.path.abspath(src))
    assert "params" in jax_ucp.restore(old)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("name", ["z2_bf16_dp3", "z3_fp32_dp3"])
def test_missing_dp_rank_file(tmp_path, name):
    src = copy_deepspeed_fixture(tmp_path, name)
    victim = glob.glob(
        os.path.join(src, "global_step2", "*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    )[0]
    os.remove(victim)
    dst = str(tmp_path / "out")
    with pytest.raises(
        SourceError,
        match=os.path.basename(victim) + ".*optimizer file.*DP rank 1",
    ):
        convert(src, dst, format="deepspeed")
    assert_destination_untouched(dst)


def test_missing_stage3_model_states_file(tmp_path):
    src = copy_deepspeed_fixture(tmp_path, "z3_bf16_dp2")
    os.remove(os.path.join(src, "global_step2", "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    with pytest.raises(SourceError, match=r"zero_pp_rank_1_mp_rank_00_model_states.pt: missing"):
        convert(src, tmp_path / "out", format="deepspeed")
    assert_destination_untouched(str(tmp_path / "out"))


def test_world_size_metadata_disagrees_with_files(tmp_path):
    src = copy_deepspeed_fixture(tmp_path, "z1_fp32_dp2")
    tag = os.path.join(src, "global_step2")
    shutil.copy(
        os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        os.path.join(tag, "zero_pp_rank_2_mp_rank_00_optim_states.pt"),
    )
    with pytest.raises(SourceError, match=r"2 DP ranks.*zero_pp_rank_2"):
        convert(src, tmp_path / "out", format="deepspeed")
    assert_destination_untouched(str(tmp_path / "out"))


def test_checkpoint_from_another_world_size_mixed_in(tmp_path):
    """A dp3 rank-0 file next to dp2 files: partition counts disagree -> named error."""
    src = copy_deepspeed_fixture(tmp_path, "z2_fp32_dp2")
    shutil.copy(
        os.path.join(
            FIX, "z2_fp32_dp3", "ckpt", "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        ),
        os.path.join(src, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    )
    with pytest.raises(
        SourceError,
        match=r"mp_rank_00_model_states.pt: dp_world_size is 2.*3|optimizer file.*DP rank 2",
    ):
        convert(src, tmp_path / "out", format="deepspeed")
    assert_destination_untouched(str(tmp_path / "out"))


@pytest.mark.parametrize("which", ["optim", "model"])
def test_truncated_file(tmp_path, which):
    src = copy_deepspeed_fixture(tmp_path, "z2_bf16_dp2")
    pat = "bf16_zero_pp_rank_1_*optim*" if which == "optim" else "mp_rank_00_model_states.pt"
    victim = glob.glob(os.path.join(src, "global_step2", pat))[0]
    data = open(victim, "rb").read()
    open(victim, "wb").write(data[: len(data) // 2])
    with pytest.raises(TorchFileError, match=os.path.basename(victim)):
        convert(src, tmp_path / "out", format="deepspeed")
    assert_destination_untouched(str(tmp_path / "out"))


def test_not_a_checkpoint_and_bad_latest(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceError, match="no DeepSpeed checkpoint here"):
        convert(empty, tmp_path / "out", format="deepspeed")
    src = copy_deepspeed_fixture(tmp_path, "z1_fp32_dp2")
    open(os.path.join(src, "latest"), "w").write("global_step9")
    with pytest.raises(SourceError, match="latest names tag 'global_step9'"):
        convert(src, tmp_path / "out", format="deepspeed")
    os.remove(os.path.join(src, "latest"))
    os.symlink("global_step9", os.path.join(src, "latest"))  # a link to nothing: refused
    with pytest.raises(SourceError, match=r"latest: listed, but no file there"):
        convert(src, tmp_path / "out", format="deepspeed")


def test_groups_disagreeing_on_step_is_an_error():
    checkpoint = open_deepspeed_checkpoint(LocalDirectory(os.path.join(FIX, "z1_fp32_dp3", "ckpt")))
    assert optimizer_step(checkpoint) == 2
    group_state = checkpoint.optim_states[2]["base_optimizer_state"]["state"][0]
    group_state["step"] = np.float32(3)
    with pytest.raises(SourceError, match=r"optimizer step: 2 in .*rank_0.*, 3 in .*rank_2"):
        optimizer_step(checkpoint)


def test_a_checkpoints_names_and_shapes_are_built_once():
    """Asked per parameter and optimizer state: rebuilt on each ask they cost O(N^2) in the
    parameter count (a MoE of tens of thousands of tensors)."""
    checkpoint = open_deepspeed_checkpoint(LocalDirectory(os.path.join(FIX, "z1_fp32_dp3", "ckpt")))
    assert checkpoint.shapes is checkpoint.shapes and checkpoint.names is checkpoint.names
    assert list(checkpoint.shapes) == checkpoint.names and len(checkpoint.names) > 1


# Hostile inputs, each built here: a clear error naming the file, or an exact import.


DS_FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")


TAG = "global_step2"


def _copy(tmp_path, name: str):
    dst = tmp_path / "src"
    shutil.copytree(os.path.join(DS_FIXTURES, name, "ckpt"), dst)
    return dst


def _as_nodes(obj, arrays: list):
    """A loaded DeepSpeed object as the torch-free writer's nodes (tensors -> TensorSlot)."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return torch_zip.TensorSlot(len(arrays) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, StandIn):
        module, name = type(obj).qualname.rsplit(".", 1)
        state = {k: _as_nodes(v, arrays) for k, v in obj.__dict__.items() if k != "args"}
        return pickle_format.New(pickle_format.Global(module, name), state)
    if isinstance(obj, int) and hasattr(type(obj), "qualname"):  # an IntEnum stand-in
        module, name = type(obj).qualname.rsplit(".", 1)
        return pickle_format.Call(pickle_format.Global(module, name), (int(obj),))
    if isinstance(obj, dict):
        return {k: _as_nodes(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_nodes(v, arrays) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_as_nodes(v, arrays) for v in obj)
    return obj


def _rewrite(path, edit) -> None:
    """``edit(obj)`` on the unpickled file (copied out of its memory map), saved back in place
    under the same name (the name inside the archive stays the file's)."""
    obj = deepspeed_files.load_deepspeed_file(LocalDirectory(str(path.parent)), path.name)
    arrays: list = []
    nodes = _as_nodes(obj, arrays)
    arrays = [np.array(a) for a in arrays]
    edit(nodes, arrays)
    os.unlink(path)
    torch_zip.save_file(str(path), nodes, arrays)


def _restore_params(path) -> dict:
    return jax_ucp.restore(path)["params"]


@pytest.mark.timeout(120)
def test_rewriting_a_deepspeed_file_keeps_it_exact(tmp_path):
    """The helper every DeepSpeed case below relies on: a file read and written back unchanged
    imports bit-exact."""
    src = _copy(tmp_path, "z2_fp32_dp2")
    for name in os.listdir(src / TAG):
        _rewrite(src / TAG / name, lambda nodes, arrays: None)
    jax_ucp.convert(src, tmp_path / "rewritten")
    jax_ucp.convert(os.path.join(DS_FIXTURES, "z2_fp32_dp2", "ckpt"), tmp_path / "original")
    got, want = _restore_params(tmp_path / "rewritten"), _restore_params(tmp_path / "original")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


ZERO2 = "z2_fp32_dp2"


RANK0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


MODEL = "mp_rank_00_model_states.pt"


def _set_fragment(src, name: str, **address) -> None:
    def edit(nodes, arrays):
        nodes["optimizer_state_dict"]["param_slice_mappings"][0][name].state.update(address)

    _rewrite(src / TAG / RANK0, edit)


def _drop_module_weights(src) -> None:
    """Without the model weights beside them, nothing else could catch a wrong master."""

    def edit(nodes, arrays):
        nodes["module"] = {}

    _rewrite(src / TAG / MODEL, edit)


def _set_shape(src, name: str, shape) -> None:
    def edit(nodes, arrays):
        nodes["param_shapes"][0][name] = pickle_format.torch_size(shape)

    _rewrite(src / TAG / MODEL, edit)


FRAGMENT_CASES = {
    # h.0.attn_proj.weight is [1552, 1808) of rank 0's partition, its bias [1808, 1824)
    "a parameter mapped onto another's range": (
        lambda src: _set_fragment(src, "h.0.attn_proj.bias", start=1552),
        rf"{RANK0}: parameters 'h\.0\.attn_proj\.bias' \(elements \[1552, 1568\)\) and "
        r"'h\.0\.attn_proj\.weight' \(\[1552, 1808\)\) overlap in group 0's partition",
    ),
    "a negative start": (
        lambda src: _set_fragment(src, "h.0.attn_proj.bias", start=-16),
        rf"{RANK0}: parameter 'h\.0\.attn_proj\.bias': fragment_address start=-16 numel=16; "
        r"expected a start >= 0 and numel > 0",
    ),
    "a negative numel": (
        lambda src: _set_fragment(src, "h.0.attn_proj.bias", numel=-16),
        rf"{RANK0}: parameter 'h\.0\.attn_proj\.bias': fragment_address start=1808 numel=-16",
    ),
    "a fragment past its partition": (
        lambda src: _set_fragment(src, "h.0.attn_proj.bias", start=3960),
        rf"{RANK0}: parameter 'h\.0\.attn_proj\.bias': fragment \[3960, 3976\) reaches past the "
        r"end of group 0's partition of 3964 elements",
    ),
    "a negative dim in param_shapes": (
        lambda src: _set_shape(src, "h.0.attn_proj.weight", (-16, -16)),
        rf"{MODEL}: param_shapes\['h\.0\.attn_proj\.weight'\] is \(-16, -16\); expected a shape "
        r"of non-negative integers",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(FRAGMENT_CASES))
def test_bad_fragment_map_is_refused_before_reading(tmp_path, case):
    damage, message = FRAGMENT_CASES[case]
    src = _copy(tmp_path, ZERO2)
    _drop_module_weights(src)
    damage(src)
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content, message",
    [
        (b"global_step2\x00", r"latest: names tag 'global_step2\\x00', which holds the control "),
        (b"global_\x00step2\n", r"latest: names tag 'global_\\x00step2', which holds the control "),
        (b"global_step2\xff", r"latest: not UTF-8 text \(byte 12\)"),
    ],
)
def test_deepspeed_latest_with_a_nul_or_bad_bytes_is_a_clear_error(tmp_path, content, message):
    src = _copy(tmp_path, ZERO2)
    (src / "latest").write_bytes(content)
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


# Inputs a careless or hostile user hands over, built here torch-free: each imports exactly or is
# refused naming the file, the key and the cause (never an internal "please report").


def _steps_as_ints(src) -> float:
    """Every rank's Adam ``step`` rewritten as a Python int (older torch pickled ints); returns
    the step the tensors held."""
    steps = []
    for path in sorted((src / TAG).glob("*optim_states.pt")):

        def edit(nodes, arrays):
            for group in nodes["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
                value = float(arrays[group["step"].index].reshape(()))
                steps.append(value)
                group["step"] = int(value)

        _rewrite(path, edit)
    assert len(set(steps)) == 1 and steps
    return steps[0]


def _flat(tree, prefix=()) -> dict:
    if isinstance(tree, dict):
        return {k: v for name, sub in tree.items() for k, v in _flat(sub, (*prefix, name)).items()}
    return {prefix: tree}


@pytest.mark.timeout(120)
def test_zero1_adam_step_pickled_as_an_int_imports(tmp_path):
    src = _copy(tmp_path, "z1_fp32_dp2")
    truth = jax_ucp.restore(jax_ucp.convert(_copy(tmp_path / "t", "z1_fp32_dp2"), tmp_path / "u"))
    step = _steps_as_ints(src)
    out = jax_ucp.convert(src, tmp_path / "out")
    restored = jax_ucp.restore(out)
    assert int(restored["opt_state"]["count"]) == int(step) == int(truth["opt_state"]["count"])
    flat, want = _flat(restored), _flat(truth)
    assert flat.keys() == want.keys()
    for key, value in want.items():
        assert np.array_equal(np.asarray(flat[key]), np.asarray(value)), key
    entry = next(e for e in jax_ucp.inspect(out).tensors if list(e.key) == ["opt_state", "count"])
    values = entry.provenance["values"]
    assert len(values) == 2 and all(v.endswith("base_optimizer_state.state.0.step") for v in values)


# Nothing outside the checkpoint is read, and no tensor borrows another's bytes.


DS = "deepspeed/z2_bf16_dp2/ckpt"


DS_RANK1 = "global_step2/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"


LEGACY = "megatron/legacy_gpt_tp2pp2_synthetic"


def _link_out(rel):
    def damage(src, tmp):
        move_out(src / rel, tmp / "elsewhere")

    return damage


LINKED_OUT = {
    "DeepSpeed optimizer rank file": (
        DS,
        _link_out(DS_RANK1),
        r"optim_states\.pt: file name 'bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt' resolves "
        r"to \S+/elsewhere/\S+, outside the checkpoint",
    ),
    "DeepSpeed model states file": (
        DS,
        _link_out("global_step2/mp_rank_00_model_states.pt"),
        r"file name 'mp_rank_00_model_states\.pt' resolves to \S+/elsewhere/",
    ),
    "Megatron torch_dist .distcp": (
        "megatron/gpt_tp2",
        _link_out("__1_0.distcp"),
        r"gpt_tp2/\.metadata: storage file: file name '__1_0\.distcp' resolves to "
        r"\S+/elsewhere/__1_0\.distcp, outside the checkpoint",
    ),
    "Megatron torch_dist common.pt": (
        "megatron/gpt_tp2",
        _link_out("common.pt"),
        r"gpt_tp2/common\.pt: file name 'common\.pt' resolves to \S+/elsewhere/common\.pt, "
        r"outside",
    ),
    "Megatron legacy rank file": (
        LEGACY,
        _link_out("iter_0000007/mp_rank_01_001/model_optim_rng.pt"),
        r"iter_0000007/mp_rank_01_001/model_optim_rng\.pt: file name "
        r"'mp_rank_01_001/model_optim_rng\.pt' resolves to "
        r"\S+/elsewhere/",
    ),
    "Megatron legacy rank directory": (
        LEGACY,
        _link_out("iter_0000007/mp_rank_01_000"),
        r"iter_0000007: file name 'mp_rank_01_000' resolves to \S+/elsewhere/mp_rank_01_000, "
        r"outside the checkpoint",
    ),
    "DeepSpeed universal zero folder": (
        "deepspeed/z1_bf16_dp2/universal",
        _link_out("global_step2_universal/zero"),
        r"global_step2_universal: file name 'zero' resolves to \S+/elsewhere/zero, outside",
    ),
    "torch DCP .metadata": (
        "torch/fsdp2_fp32",
        _link_out(".metadata"),
        r"fsdp2_fp32/\.metadata: file name '\.metadata' resolves to \S+/elsewhere/\.metadata, outside",
    ),
    "torch Accelerate DCP folder": (
        "torch/accelerate_fsdp",
        _link_out("optimizer_0"),
        r"accelerate_fsdp: file name 'optimizer_0' resolves to \S+/elsewhere/optimizer_0, outside",
    ),
    "torch .bin index": (
        "torch/hf_bin_sharded",
        _link_out("pytorch_model.bin.index.json"),
        r"hf_bin_sharded: file name 'pytorch_model\.bin\.index\.json' resolves to \S+/elsewhere/",
    ),
    "Megatron Bridge iteration folder": (
        "megatron_bridge/llama_tp1dp2",
        _link_out("iter_0000002"),
        r"llama_tp1dp2: file name 'iter_0000002' resolves to \S+/elsewhere/iter_0000002, "
        r"outside the checkpoint",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(LINKED_OUT))
def test_rank_files_linked_outside_are_refused(tmp_path, case):
    """A rank file (or rank folder) of a real DeepSpeed / megatron-core checkpoint replaced by a
    symlink to the same bytes moved elsewhere: refused naming it, nothing written. Before, each
    was read through the link."""
    rel, damage, message = LINKED_OUT[case]
    src = copy_fixture(tmp_path, rel, name=os.path.basename(rel))
    damage(src, tmp_path)
    dst = tmp_path / "out"
    megatron = case.startswith("Megatron ") and "Bridge" not in case
    options = {"importing": MegatronOptions(vocab_size=61)} if megatron else {}
    assert_convert_refused(src, dst, message, **options)


@pytest.mark.timeout(120)
def test_rank_files_and_folders_linked_inside_read_exactly(tmp_path):
    """Links that stay inside: a DeepSpeed tag folder linked to a folder elsewhere in the
    checkpoint, a Megatron legacy rank file linked to a copy in its rank folder: both import
    exactly as the originals."""
    for rel, options, link in (
        (DS, {}, lambda src: _link_within(src, "global_step2", src / "kept")),
        (
            LEGACY,
            {"importing": MegatronOptions(vocab_size=61)},
            lambda src: _link_within(
                src, "iter_0000007/mp_rank_01_001/model_optim_rng.pt", src / "iter_0000007/kept"
            ),
        ),
    ):
        want = restored_params(
            jax_ucp.convert(os.path.join(FIXTURES, rel), tmp_path / "ref", **options)
        )
        src = copy_fixture(tmp_path, rel, name=os.path.basename(rel))
        link(src)
        got = restored_params(jax_ucp.convert(src, tmp_path / "out", **options))
        assert sorted(got) == sorted(want)
        for name in want:
            assert_bit_exact(got[name], want[name], name)
        for path in (tmp_path / "ref", tmp_path / "out", src):
            shutil.rmtree(path)


def _link_within(src, rel: str, store) -> None:
    """``src/rel`` moved into ``store`` (inside the checkpoint) and replaced by a link to it."""
    move_out(src / rel, store)
