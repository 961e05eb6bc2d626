"""Trust holes in the importers' inputs: patterns from files, spec files, DeepSpeed fragment maps
and tracker files, safetensors headers. Each hostile input is built here from a real fixture (or
from scratch), and is either a clear error naming the file or imports exactly; every test has a
timeout, so a hang is a failure.

DeepSpeed files are rewritten without torch: read with the importer's own restricted reader,
changed, and written back with the exporter's torch-free ``torch.save`` writer.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

import jax_ucp
from jax_ucp.exporters import torch_out
from jax_ucp.importers.deepspeed import files as deepspeed_files
from jax_ucp.importers.torch.unpickler import StandIn
from jax_ucp.language import SpecError, load_spec, spec_from_toml
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "deepspeed")
TAG = "global_step2"


# --------------------------------------------------------------------------- helpers


def _copy(tmp_path, name: str):
    dst = tmp_path / "src"
    shutil.copytree(os.path.join(FIXTURES, name, "ckpt"), dst)
    return dst


def _as_nodes(obj, arrays: list):
    """A loaded DeepSpeed object as the torch-free writer's nodes (tensors -> TensorSlot)."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return torch_out.TensorSlot(len(arrays) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, StandIn):
        module, name = type(obj).qualname.rsplit(".", 1)
        state = {k: _as_nodes(v, arrays) for k, v in obj.__dict__.items() if k != "args"}
        return torch_out.New(torch_out.Global(module, name), state)
    if isinstance(obj, int) and hasattr(type(obj), "qualname"):  # an IntEnum stand-in
        module, name = type(obj).qualname.rsplit(".", 1)
        return torch_out.Call(torch_out.Global(module, name), (int(obj),))
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
    obj = deepspeed_files.load_deepspeed_file(str(path))
    arrays: list = []
    nodes = _as_nodes(obj, arrays)
    arrays = [np.array(a) for a in arrays]
    edit(nodes, arrays)
    os.unlink(path)
    torch_out.save_file(str(path), nodes, arrays)


def _restore_params(path) -> dict:
    return jax_ucp.restore(path)["params"]


# --------------------------------------------------------------------------- the rewriter


@pytest.mark.timeout(120)
def test_rewriting_a_deepspeed_file_keeps_it_exact(tmp_path):
    """The helper every DeepSpeed case below relies on: a file read and written back unchanged
    imports bit-exact."""
    src = _copy(tmp_path, "z2_fp32_dp2")
    for name in os.listdir(src / TAG):
        _rewrite(src / TAG / name, lambda nodes, arrays: None)
    jax_ucp.convert(src, tmp_path / "rewritten")
    jax_ucp.convert(os.path.join(FIXTURES, "z2_fp32_dp2", "ckpt"), tmp_path / "original")
    got, want = _restore_params(tmp_path / "rewritten"), _restore_params(tmp_path / "original")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


# --------------------------------------------------------------------------- patterns from files

MEGATRON_DS = "megatron_ds_tp2_dp2_z1_bf16_synthetic"
MP0 = "mp_rank_00_model_states.pt"
CATASTROPHIC = r"(\w+\.?)+\.never"  # exponential backtracking in Python's re on every name


def _add_ucp_info_pattern(src, key: str, pattern: str) -> None:
    def edit(nodes, arrays):
        nodes["universal_checkpoint_info"].setdefault(key, []).append(pattern)

    _rewrite(src / TAG / MP0, edit)


@pytest.mark.timeout(60)
def test_catastrophic_pattern_in_universal_checkpoint_info_imports_exactly(tmp_path):
    """A pattern that backtracks exponentially in Python's re matches in linear time on RE2: it
    matches nothing here, so the import is the original's, bit for bit."""
    src = _copy(tmp_path, MEGATRON_DS)
    _add_ucp_info_pattern(src, "tp_replicated_parameter_patterns", CATASTROPHIC)
    _add_ucp_info_pattern(src, "vocabulary_parameter_patterns", CATASTROPHIC)
    jax_ucp.convert(src, tmp_path / "hostile")
    jax_ucp.convert(os.path.join(FIXTURES, MEGATRON_DS, "ckpt"), tmp_path / "original")
    got, want = jax_ucp.restore(tmp_path / "hostile"), jax_ucp.restore(tmp_path / "original")
    for tree in ("params", "model_params"):
        assert sorted(got[tree]) == sorted(want[tree])
        for name in want[tree]:
            np.testing.assert_array_equal(got[tree][name], want[tree][name])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "pattern, reason",
    [
        (r"(?=language)language_model\..*", r"invalid perl operator: \(\?="),
        (r"(language)\1", r"invalid escape sequence: \\1"),
    ],
)
def test_pattern_re2_cannot_run_is_an_error_naming_file_and_pattern(tmp_path, pattern, reason):
    src = _copy(tmp_path, MEGATRON_DS)
    _add_ucp_info_pattern(src, "parameter_with_row_parallelism_patterns", pattern)
    with pytest.raises(jax_ucp.UCPError) as e:
        jax_ucp.convert(src, tmp_path / "out")
    message = str(e.value)
    assert message.startswith(str(src / TAG / MP0) + ": universal_checkpoint_info.")
    assert "parameter_with_row_parallelism_patterns" in message
    assert repr(pattern) in message
    assert re_search(reason, message)
    assert not os.path.exists(tmp_path / "out")


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


@pytest.mark.timeout(30)
def test_catastrophic_pattern_in_a_spec_file_matches_in_bounded_time(tmp_path):
    toml = tmp_path / "hostile.toml"
    toml.write_text(
        f"[[import]]\npattern = '{CATASTROPHIC}'\nkind = 'replicated'\n"
        "[[import]]\npattern = '.*'\nkind = 'replicated'\n"
    )
    spec = load_spec(toml)
    name = "language_model.encoder.layers.0.self_attention.query_key_value.weight" * 20
    assert spec.match(name).index == 1  # the first rule does not match, the second does


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"(?<=x)w", r"bad regex '\(\?<=x\)w': invalid perl operator"),
        (r"(?P<a>x)(?P=a)", r"bad regex '\(\?P<a>x\)\(\?P=a\)'"),
        (r"x{,3}", r"write '\{0,n\}' instead of '\{,n\}'"),
        ("x" * 5000, r"5000 characters long; at most 4096"),
    ],
)
def test_spec_file_pattern_re2_cannot_run_names_file_and_rule(tmp_path, pattern, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(f"name = 'bad'\n\n[[restore]]\npattern = '{pattern}'\n")
    with pytest.raises(SpecError, match=rf"bad\.toml line 3: restore rule #1: .*{message}"):
        load_spec(toml)


@pytest.mark.timeout(30)
def test_also_patterns_round_trip_through_toml():
    """``also`` (the name must match these too) is part of the file form."""
    from jax_ucp.language import ImportRule, Spec, spec_to_toml

    spec = Spec(imports=[ImportRule("a.*", "replicated", also=("(?:.*b)",))], strict=False)
    back = spec_from_toml(spec_to_toml(spec))
    assert back.imports == spec.imports
    assert back.match("axb") is not None and back.match("axc") is None


# --------------------------------------------------------------------------- ZeRO-1/2 fragment maps

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
        nodes["param_shapes"][0][name] = torch_out.torch_size(shape)

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


# --------------------------------------------------------------------------- tracker files


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


# --------------------------------------------------------------------------- spec files: size


DEEP_TOML = {
    "arrays nested 100k deep": "name = 'x'\nsettings = {a = "
    + "[" * 100_000
    + "]" * 100_000
    + "}\n",
    "inline tables nested 100k deep": "[settings]\na = " + "{b = " * 100_000 + "1" + "}" * 100_000,
    "a dotted key of 100k parts": "[settings]\n" + ".".join(["k"] * 100_000) + " = 1\n",
    "a table header of 100k parts": "[" + ".".join(["k"] * 100_000) + "]\n",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(DEEP_TOML))
def test_deeply_nested_spec_file_is_refused_naming_it(tmp_path, case):
    toml = tmp_path / "deep.toml"
    toml.write_text(DEEP_TOML[case])
    with pytest.raises(SpecError, match=r"deep\.toml line \d+: nested deeper than 64 levels"):
        load_spec(toml)


@pytest.mark.timeout(30)
def test_nesting_inside_strings_and_comments_is_not_counted():
    """Brackets and dots in regexes, strings and comments are text, not nesting."""
    deep = "[" * 100 + "." * 100
    text = (
        f"name = 'x' # {deep}\n"
        f'description = """{deep}\\""""\n'
        f"[[import]]\npattern = '{'[a]' * 100}.*'\nlabel = \"{deep}\"\nkind = 'replicated'\n"
    )
    spec = spec_from_toml(text, source="ok.toml")
    assert spec.description == deep + '"'
    assert spec.match("a" * 100 + "b") is not None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "toml, message",
    [
        (
            "[[import]]\npattern = 'w'\nkind = 'partitioned'\ndim = '" + "1+" * 50_000 + "1'\n",
            r"big\.toml line 1: import rule #1: kind 'partitioned': parameter 'dim' holds a string "
            r"of 100001 characters; at most 1000",
        ),
        (
            "[[restore]]\npattern = 'w'\nops = [{op = 'transpose', perm = ['"
            + "1+" * 50_000
            + "1', '0']}]\n",
            r"big\.toml line 1: restore rule #1 op #1: op 'transpose': parameter 'perm' holds a "
            r"string of 100001 characters",
        ),
        (
            "[[restore]]\npattern = 'w'\ntarget = 'w_{" + "1+" * 50_000 + "1}'\n",
            r"big\.toml line 1: restore rule #1: w: target must be a template string of at most "
            r"4096 characters",
        ),
    ],
)
def test_huge_expression_in_a_spec_file_is_refused_naming_it(tmp_path, toml, message):
    path = tmp_path / "big.toml"
    path.write_text(toml)
    with pytest.raises(SpecError, match=message):
        load_spec(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "expression, message",
    [
        ("1+" * 50_000 + "1", r"is 100001 characters long; at most 1000"),
        ("-" * 999 + "1", r"nests deeper than 64 levels"),
        ("1+" * 400 + "1", r"nests deeper than 64 levels"),
    ],
)
def test_expression_size_and_depth_are_bounded(expression, message):
    from jax_ucp.language.settings import eval_int

    with pytest.raises(SpecError, match=rf"^rule: expression .*{message}"):
        eval_int(expression, {}, where="rule: ")
    assert eval_int("(" * 150 + "hidden * 4" + ")" * 150, {"hidden": 3}) == 12


@pytest.mark.timeout(30)
def test_spec_file_bigger_than_the_cap_is_refused_unread(tmp_path):
    path = tmp_path / "huge.toml"
    with open(path, "wb") as f:
        f.truncate((4 << 20) + 1)
    with pytest.raises(SpecError, match=r"huge\.toml: more than 4194304 bytes; not a spec file"):
        load_spec(path)


@pytest.mark.timeout(60)
def test_cli_reports_a_spec_error_like_other_errors(tmp_path):
    """A deep spec file given to ``jax-ucp convert`` is one clear line and exit 1, not a
    traceback (a RecursionError before)."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    toml = tmp_path / "deep.toml"
    toml.write_text(DEEP_TOML["arrays nested 100k deep"])
    src = os.path.join(FIXTURES, MEGATRON_DS, "ckpt")
    r = CliRunner().invoke(
        app, ["convert", "deepspeed", src, str(tmp_path / "out"), "--spec", str(toml)]
    )
    assert r.exit_code == 1, r.output
    assert "error:" in r.output and "nested deeper than 64 levels" in r.output
    assert "Traceback" not in r.output
    assert not os.path.exists(tmp_path / "out")


# --------------------------------------------------------------------------- safetensors


def _safetensors(path, header_json: str, data: bytes) -> None:
    """A safetensors file with this exact header text (duplicate keys survive)."""
    raw = header_json.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


F32 = '{{"dtype": "F32", "shape": [2], "data_offsets": [{0}, {1}]}}'


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "header, message",
    [
        (
            '{"w": ' + F32.format(0, 8) + ', "w": ' + F32.format(8, 16) + "}",
            r"model\.safetensors: the header: names 'w' twice \(a JSON object with a duplicate key\)",
        ),
        (
            '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "dtype": "I32"}}',
            r"model\.safetensors: the header: names 'dtype' twice",
        ),
        (
            '{"__metadata__": {"format": "pt", "format": "np"}, "w": ' + F32.format(0, 8) + "}",
            r"model\.safetensors: the header: names 'format' twice",
        ),
    ],
    ids=["tensor", "field", "metadata"],
)
def test_safetensors_header_with_a_duplicate_key_is_refused(tmp_path, header, message):
    src = tmp_path / "hf"
    src.mkdir()
    _safetensors(src / "model.safetensors", header, np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(jax_ucp.UCPError, match=message):
        jax_ucp.convert(src, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.timeout(30)
def test_safetensors_index_with_a_duplicate_tensor_is_refused(tmp_path):
    from safetensors.numpy import save_file

    src = tmp_path / "hf"
    src.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(src / "one.safetensors"))
    save_file({"b": np.ones(2, np.float32)}, str(src / "two.safetensors"))
    (src / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "one.safetensors", "b": "two.safetensors", "a": "two.safetensors"}}'
    )
    with pytest.raises(jax_ucp.UCPError, match=r"model\.safetensors\.index\.json: names 'a' twice"):
        jax_ucp.convert(src, tmp_path / "out")


def _dcp_shards(src, full: np.ndarray) -> list:
    """What torch DCP's HuggingFaceStorageWriter writes without consolidation for a tensor
    row-sharded over 2 ranks plus a replicated one: one file per rank, each tensor that rank's
    piece, its place in the full tensor in ``__metadata__["DCP_SHARDING_INFO"]``."""
    from safetensors.numpy import save_file

    rows = full.shape[0] // 2
    paths = []
    for rank in range(2):
        piece = np.ascontiguousarray(full[rank * rows : (rank + 1) * rows])
        sharding = {"w": {"saved_offsets": [rank * rows, 0]}, "b": {"saved_offsets": [0]}}
        path = src / f"shard-{rank:05d}-model-00001-of-00001.safetensors"
        save_file(
            {"w": piece, "b": np.ones(3, np.float32)},
            str(path),
            metadata={"DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0"},
        )
        paths.append(path)
    return paths


@pytest.mark.timeout(30)
def test_unconsolidated_dcp_shard_is_refused_as_a_file_and_as_a_folder(tmp_path):
    src = tmp_path / "dcp_hf"
    src.mkdir()
    first, _ = _dcp_shards(src, np.arange(24, dtype=np.float32).reshape(4, 6))
    expected = (
        r"shard-00000-model-00001-of-00001\.safetensors: an unconsolidated shard of "
        r"torch\.distributed\.checkpoint's Hugging Face writer \(__metadata__ has "
        r"DCP_SHARDING_INFO\): its tensors are pieces of larger ones \(e\.g\. 'w' has "
        r"saved_offsets \[0, 0\]\).*Consolidate the shards first"
    )
    with pytest.raises(jax_ucp.UCPError, match=expected):  # rank 0's half as the whole: refused
        jax_ucp.convert(first, tmp_path / "one")
    with pytest.raises(jax_ucp.UCPError, match=expected) as e:  # never "pass one file"
        jax_ucp.convert(src, tmp_path / "all")
    assert "pass one file" not in str(e.value) and "the one file" not in str(e.value)
    assert not os.path.exists(tmp_path / "one") and not os.path.exists(tmp_path / "all")


# --------------------------------------------------------------------------- the unpickler


def _shared_tuple_key(levels: int) -> bytes:
    """Pickle ops leaving ``t[levels-1]`` on the stack, ``t[k] = (t[k-1], t[k-1])``: a few bytes
    per level, ``2**levels`` work to hash."""
    import pickle as P

    ops = P.EMPTY_TUPLE + P.BINPUT + b"\x00" + P.POP
    for k in range(1, levels):
        ops += P.BINGET + bytes([k - 1]) + P.BINGET + bytes([k - 1]) + P.TUPLE2
        ops += P.BINPUT + bytes([k]) + P.POP
    return ops + P.BINGET + bytes([levels - 1])


@pytest.mark.timeout(10)
def test_ordered_dict_built_from_pairs_checks_keys_before_hashing(tmp_path):
    """``REDUCE(OrderedDict, ([(key, None)],))`` hashed its key unchecked: a 64-level shared
    tuple (about 600 bytes of pickle) never finished hashing."""
    import pickle as P

    from jax_ucp.importers.torch.unpickler import TorchFileError, restricted_loads

    key = _shared_tuple_key(64)
    bomb = (
        b"\x80\x02" + P.GLOBAL + b"collections\nOrderedDict\n"
        + P.MARK + key + P.NONE + P.TUPLE2 + P.LIST + P.TUPLE1 + P.REDUCE + P.STOP
    )  # fmt: skip
    with pytest.raises(
        TorchFileError,
        match=r"^bomb\.pt: REDUCE collections\.OrderedDict: dict key .* is not a scalar or a flat "
        r"tuple of scalars",
    ):
        restricted_loads(bomb, where="bomb.pt")
    plain = b"\x80\x02" + P.GLOBAL + b"collections\nOrderedDict\n"
    plain += P.MARK + P.BINUNICODE + struct.pack("<I", 1) + b"a" + P.NONE + P.TUPLE2
    plain += P.LIST + P.TUPLE1 + P.REDUCE + P.STOP
    assert restricted_loads(plain, where="ok.pt") == {"a": None}
