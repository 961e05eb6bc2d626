"""The torch-free restricted reader: tensors exact, hostile or broken files refused by name."""

from __future__ import annotations

import collections
import glob
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib

import ml_dtypes
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp._src.torchfiles.allow_list import (
    StandIn,
    TorchFileError,
    int_enum_standin,
    short_repr,
    standin_class,
)
from jax_ucp._src.torchfiles.pickle_format import restricted_loads
from jax_ucp._src.torchfiles.torch_zip import (
    MAX_COMPRESSED_MEMBER,
    MAX_INFLATED_TOTAL,
    load_torch_file,
)
from tests.ucp_testing import REPO, python_lines

FIX = os.path.join(REPO, "tests", "fixtures", "deepspeed")

# ------------------------------------------------------------------ a tiny pickle assembler
P = pickle


def G(mod: str, name: str) -> bytes:
    return P.GLOBAL + f"{mod}\n{name}\n".encode()


def D(x) -> bytes:
    """A plain-data fragment (protocol 2 body without PROTO/STOP)."""
    b = pickle.dumps(x, protocol=2)
    assert b[:2] == b"\x80\x02" and b[-1:] == P.STOP
    return b[2:-1]


def prog(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + P.STOP


def tensor(stype: str, key: str, numel: int, offset: int, size, stride) -> bytes:
    pid = (
        P.MARK
        + D("storage")
        + G("torch", stype)
        + D(key)
        + D("cpu")
        + D(numel)
        + P.TUPLE
        + P.BINPERSID
    )
    hooks = G("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE
    return (
        G("torch._utils", "_rebuild_tensor_v2")
        + P.MARK
        + pid
        + D(offset)
        + D(tuple(size))
        + D(tuple(stride))
        + P.NEWFALSE
        + hooks
        + P.TUPLE
        + P.REDUCE
    )


def write_pt(path, pkl: bytes, storages: dict[str, bytes] | None = None, compress=False) -> str:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for k, v in (storages or {}).items():
            z.writestr(f"archive/data/{k}", v)
        z.writestr("archive/version", "3\n")
    return str(path)


# ------------------------------------------------------------------ tensors


def test_tensor_geometry_views_and_dtypes(tmp_path):
    base = np.arange(60, dtype=np.float32)
    bf = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16)
    pkl = prog(
        P.EMPTY_DICT,
        P.MARK,
        D("full"),
        tensor("FloatStorage", "0", 60, 0, (3, 4, 5), (20, 5, 1)),
        D("view"),
        tensor("FloatStorage", "0", 60, 21, (2, 2), (20, 2)),  # t[1:, 0, 1::2][:2]-like
        D("transposed"),
        tensor("FloatStorage", "0", 60, 0, (5, 4, 3), (1, 5, 20)),
        D("scalar"),
        tensor("FloatStorage", "0", 60, 7, (), ()),
        D("bf16"),
        tensor("BFloat16Storage", "1", 12, 2, (2, 5), (5, 1)),
        D("empty"),
        tensor("FloatStorage", "0", 60, 0, (0, 3), (3, 1)),
        D("shape"),
        G("torch", "Size") + D(((2, 3),)) + P.REDUCE,
        D("enum"),
        G("pkg.mod", "Stage") + D((2,)) + P.REDUCE,
        D("frag"),
        G("pkg.mod", "Frag") + P.EMPTY_TUPLE + P.NEWOBJ + D({"numel": 5, "start": 3}) + P.BUILD,
        P.SETITEMS,
    )
    p = write_pt(tmp_path / "t.pt", pkl, {"0": base.tobytes(), "1": bf.tobytes()})
    Frag = standin_class("pkg.mod.Frag")
    got = load_torch_file(
        p, {"pkg.mod.Stage": int_enum_standin("pkg.mod.Stage"), "pkg.mod.Frag": Frag}
    )
    full = base.reshape(3, 4, 5)
    np.testing.assert_array_equal(got["full"], full)
    np.testing.assert_array_equal(
        got["view"], np.lib.stride_tricks.as_strided(base[21:], (2, 2), (80, 8))
    )
    np.testing.assert_array_equal(got["transposed"], full.transpose(2, 1, 0))
    assert got["scalar"].shape == () and got["scalar"] == 7
    assert got["bf16"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["bf16"], bf[2:12].reshape(2, 5))
    assert got["empty"].shape == (0, 3)
    assert got["shape"] == (2, 3)
    assert got["enum"] == 2 and isinstance(got["enum"], int)
    assert isinstance(got["frag"], Frag) and (got["frag"].numel, got["frag"].start) == (5, 3)
    assert not got["full"].flags.writeable
    # memory-mapped: the array views the file, it does not own a copy
    assert got["full"].base is not None and not got["full"].flags.owndata


def test_compressed_member_still_reads(tmp_path):
    base = np.arange(6, dtype=np.int64)
    p = write_pt(
        tmp_path / "c.pt",
        prog(tensor("LongStorage", "0", 6, 0, (2, 3), (3, 1))),
        {"0": base.tobytes()},
        compress=True,
    )
    np.testing.assert_array_equal(load_torch_file(p), base.reshape(2, 3))


def test_real_deepspeed_file_loads():
    files = sorted(
        glob.glob(os.path.join(FIX, "z*_bf16_dp2", "ckpt", "global_step2", "*optim_states.pt"))
    )
    assert files, "DeepSpeed fixtures missing"
    with pytest.raises(TorchFileError, match="deepspeed"):
        load_torch_file(files[0])  # DeepSpeed classes are not in the base allow-list
    from jax_ucp._src.importers.deepspeed import DS_CLASSES

    sd = load_torch_file(files[0], DS_CLASSES)
    assert sd["optimizer_state_dict"]["zero_stage"] in (1, 2, 3)


# ------------------------------------------------------------------ hostile pickles

MARKER = "/tmp/jax_ucp_pwned_marker"


@pytest.fixture(autouse=True)
def _no_marker():
    if os.path.exists(MARKER):
        os.remove(MARKER)
    yield
    assert not os.path.exists(MARKER), "pickled code was executed"


HOSTILE = {
    "global_os_system": prog(G("os", "system") + D((f"touch {MARKER}",)) + P.REDUCE),
    "global_posix_system": prog(G("posix", "system") + D((f"touch {MARKER}",)) + P.REDUCE),
    "stack_global_eval": b"\x80\x04"
    + P.SHORT_BINUNICODE
    + bytes([8])
    + b"builtins"
    + P.SHORT_BINUNICODE
    + bytes([4])
    + b"eval"
    + P.STACK_GLOBAL
    + D((f"open('{MARKER}','w')",))
    + P.REDUCE
    + P.STOP,
    "inst_os_system": prog(P.MARK + D(f"touch {MARKER}") + P.INST + b"os\nsystem\n"),
    "obj_on_string": prog(P.MARK + D("os.system") + D(f"touch {MARKER}") + P.OBJ),
    "reduce_on_data": prog(D("os.system") + D((f"touch {MARKER}",)) + P.REDUCE),
    "newobj_on_function": prog(G("torch._utils", "_rebuild_tensor_v2") + P.EMPTY_TUPLE + P.NEWOBJ),
    "build_on_dict": prog(P.EMPTY_DICT + D({"__class__": 1}) + P.BUILD),
    "build_on_list": prog(P.EMPTY_LIST + D({"x": 1}) + P.BUILD),
    "build_dunder_on_standin": prog(
        G("pkg.mod", "Frag") + P.EMPTY_TUPLE + P.NEWOBJ + D({"__class__": "x"}) + P.BUILD
    ),
    "setitem_on_standin": prog(
        G("pkg.mod", "Frag") + P.EMPTY_TUPLE + P.NEWOBJ + D("k") + D(1) + P.SETITEM
    ),
    "append_on_tuple": prog(D((1,)) + D(2) + P.APPEND),
    "ext_opcode": prog(P.EXT1 + bytes([1])),
    "text_persid": prog(P.PERSID + b"0\n"),
    "persid_not_storage": prog(D(("module", "os")) + P.BINPERSID),
    "persid_bad_type": prog(
        P.MARK + D("storage") + D("FloatStorage") + D("0") + D("cpu") + D(4) + P.TUPLE + P.BINPERSID
    ),
    "persid_path_escape": prog(
        P.MARK
        + D("storage")
        + G("torch", "FloatStorage")
        + D("../../etc/passwd")
        + D("cpu")
        + D(4)
        + P.TUPLE
        + P.BINPERSID
    ),
    "unknown_torch_global": prog(G("torch", "load") + D(("x",)) + P.REDUCE),
    "builtins_getattr": prog(G("builtins", "getattr")),
    "protocol2_builtin_eval": prog(
        G("__builtin__", "eval") + D((f"open('{MARKER}','w')",)) + P.REDUCE
    ),
    "codecs_bad_encoding": prog(G("_codecs", "encode") + D(("x", "rot13")) + P.REDUCE),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_pickle_refused(tmp_path, case):
    p = write_pt(tmp_path / f"{case}.pt", HOSTILE[case], {"0": b"\0" * 16})
    with pytest.raises(TorchFileError) as e:
        load_torch_file(p, {"pkg.mod.Frag": standin_class("pkg.mod.Frag")})
    assert str(p) in str(e.value)


def test_refusal_names_the_global(tmp_path):
    p = write_pt(tmp_path / "x.pt", HOSTILE["global_os_system"])
    with pytest.raises(TorchFileError, match=r"'os\.system'.*not in the allow-list"):
        load_torch_file(p)


def test_restricted_loads_plain_data():
    data = {
        "a": [1, 2.5, "s", None, True],
        "b": (1, (2,)),
        "c": {1, 2},
        "d": b"\x00\xff",
        "e": 1 + 2j,
        "o": collections.OrderedDict(x=1),
    }
    for proto in (2, 4, 5):
        assert restricted_loads(pickle.dumps(data, protocol=proto)) == data


@pytest.mark.parametrize(
    "bad",
    [
        ("storage beyond member", tensor("FloatStorage", "0", 100, 0, (10,), (1,))),
        ("tensor beyond storage", tensor("FloatStorage", "0", 4, 2, (3,), (1,))),
        ("stride beyond storage", tensor("FloatStorage", "0", 4, 0, (2, 2), (3, 1))),
        ("missing member", tensor("FloatStorage", "9", 4, 0, (4,), (1,))),
        ("negative stride", tensor("FloatStorage", "0", 4, 3, (2,), (-1,))),
    ],
    ids=lambda b: b[0],
)
def test_bad_tensor_references(tmp_path, bad):
    p = write_pt(tmp_path / "b.pt", prog(bad[1]), {"0": b"\0" * 16})
    with pytest.raises(TorchFileError, match=str(p).replace(".", r"\.")):
        load_torch_file(p)


# ------------------------------------------------------------------ broken files


def _real_file() -> str:
    files = sorted(glob.glob(os.path.join(FIX, "z1_fp32_dp2", "ckpt", "global_step2", "*.pt")))
    assert files
    return files[0]


@pytest.mark.parametrize("cut", [0.2, 0.5, 0.9, 0.999])
def test_truncated_file(tmp_path, cut):
    src = open(_real_file(), "rb").read()
    p = tmp_path / "trunc.pt"
    p.write_bytes(src[: int(len(src) * cut)])
    with pytest.raises(TorchFileError, match=r"trunc.pt"):
        load_torch_file(
            p, __import__("jax_ucp._src.importers.deepspeed", fromlist=["x"]).DS_CLASSES
        )


def test_corrupt_pickle_and_non_torch_files(tmp_path):
    p = write_pt(tmp_path / "garbage.pt", b"\x80\x02garbage")
    with pytest.raises(TorchFileError, match=r"garbage.pt: corrupt pickle"):
        load_torch_file(p)
    p = write_pt(tmp_path / "nostop.pt", b"\x80\x02" + D([1, 2]))
    with pytest.raises(TorchFileError, match=r"nostop.pt"):
        load_torch_file(p)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(TorchFileError, match=r"empty.pt: file is empty"):
        load_torch_file(empty)
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"rest")
    with pytest.raises(TorchFileError, match=r"legacy.pt: legacy"):
        load_torch_file(legacy)
    text = tmp_path / "text.pt"
    text.write_text("hello")
    with pytest.raises(TorchFileError, match="not a torch zip"):
        load_torch_file(text)
    with pytest.raises(TorchFileError, match=r"nope.pt: cannot open"):
        load_torch_file(tmp_path / "nope.pt")
    z = tmp_path / "nodata.pt"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("x/other", "1")
    with pytest.raises(TorchFileError, match=r"data.pkl"):
        load_torch_file(z)


def test_a_zip_version_no_reader_knows_is_a_torch_file_error(tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind torch_checkpointing
    --seed 11 --index 1``): three flipped bytes made a central-directory entry need zip version
    23.1, and zipfile's ``NotImplementedError`` escaped the import raw."""
    data = bytearray(open(_real_file(), "rb").read())
    entry = data.index(b"PK\x01\x02")  # the first central-directory entry
    struct.pack_into("<H", data, entry + 6, 231)  # "version needed to extract": 23.1
    p = tmp_path / "version.pt"
    p.write_bytes(bytes(data))
    with pytest.raises(TorchFileError, match=r"version\.pt: .*corrupt .*zip file version 23\.1"):
        load_torch_file(p)


def test_a_member_placed_before_the_file_is_a_torch_file_error(tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind torch_checkpointing
    --seed 23 --index 31``): a flipped byte in the end record's central-directory offset made
    zipfile place the members before the start of the file (it subtracts the difference as a
    prefix), and ``preadv`` at a negative offset raised a raw ``OSError`` (EINVAL)."""
    data = bytearray(open(_real_file(), "rb").read())
    end = data.rindex(b"PK\x06\x06")  # torch's zip64 end record: the directory's offset
    (at,) = struct.unpack_from("<Q", data, end + 48)
    struct.pack_into("<Q", data, end + 48, at + 65536)  # said 64 KiB later than it is
    p = tmp_path / "before.pt"
    p.write_bytes(bytes(data))
    with pytest.raises(TorchFileError, match=r"before\.pt: member .* before the file \(corrupt\)"):
        load_torch_file(p)


def test_a_storage_type_edited_in_the_pickle_is_refused(tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind torch_save --seed 17
    --index 13``, ``--kind hf_trainer --seed 17 --index 7``): ``FloatStorage`` renamed in
    ``data.pkl`` (the zip's CRCs made to agree) read the float32 bytes as half as many 2-byte
    values, since a storage member longer than its record asks was accepted. torch.save writes
    each storage's bytes exactly: any other length is refused, naming the storage."""
    from tests.importers.megatron.test_import import with_fixed_crcs

    raw = open(_real_file(), "rb").read()
    assert b"FloatStorage" in raw
    p = tmp_path / "typed.pt"
    p.write_bytes(with_fixed_crcs(raw.replace(b"FloatStorage", b"ShortStorage", 1)))
    with pytest.raises(
        TorchFileError,
        match=r"typed\.pt: storage '.+': expected \d+ bytes \(\d+ x int16\), member holds \d+ "
        r"\(its storage type edited in data\.pkl\?\)",
    ):
        load_torch_file(
            p, __import__("jax_ucp._src.importers.deepspeed", fromlist=["x"]).DS_CLASSES
        )


def test_corrupt_storage_bytes_detected_by_crc(tmp_path):
    src = bytearray(open(_real_file(), "rb").read())
    i = src.index(b"data/0") + 200  # inside the first storage's bytes
    src[i] ^= 0xFF
    p = tmp_path / "flip.pt"
    p.write_bytes(bytes(src))
    from jax_ucp._src.importers.deepspeed import DS_CLASSES

    with pytest.raises(TorchFileError, match=r"flip.pt.*CRC"):
        load_torch_file(p, DS_CLASSES, verify_crc=True)


def test_standin_repr_and_eq():
    A = standin_class("m.A")
    a, b = A(1), A(1)
    assert a == b and "m.A" in repr(a) and isinstance(a, StandIn)


# ------------------------------------------------------------------ against torch itself


@pytest.mark.torch
def test_matches_torch_load(tmp_path):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4, 5, 6, generator=g)
    obj = {
        "t": t,
        "slice": t[1:, ::2, 2:5],
        "T": t.transpose(0, 2),
        "bf": t.to(torch.bfloat16)[::2],
        "half": t.half(),
        "long": torch.arange(7),
        "bool": t > 0,
        "p": torch.nn.Parameter(t[0].clone()),
        "f8": t.to(torch.float8_e4m3fn),
        "u16": torch.tensor([1, 2], dtype=torch.uint16),
        "size": torch.Size([2, 3]),
        "dt": torch.bfloat16,
        "od": collections.OrderedDict(a=t[0, 0]),
        "nested": [t, (t[0], {"k": t[:, 0]})],
        "c64": torch.randn(3, dtype=torch.complex64),
    }
    p = tmp_path / "ref.pt"
    torch.save(obj, p)
    ref = torch.load(p, weights_only=True)
    got = load_torch_file(p)

    def cmp(a, b):
        if isinstance(a, torch.Tensor):
            a = a.detach()
            if a.dtype in (torch.bfloat16, torch.float8_e4m3fn):
                np.testing.assert_array_equal(b.astype(np.float32), a.float().numpy())
            else:
                np.testing.assert_array_equal(b, a.numpy())
            assert b.shape == tuple(a.shape)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                cmp(a[k], b[k])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                cmp(x, y)
        elif isinstance(a, torch.dtype):
            assert str(a).split(".")[-1] == str(b)
        else:
            assert a == b

    cmp(ref, got)


# Hostile torch files: each a few hundred bytes to a few MB, each refused with a clear
# TorchFileError after bounded work (lines of Python counted) and memory (a hang is a failure:
# per-test timeout).


FIXTURES = os.path.join(REPO, "tests", "fixtures")


def laughs(levels: int) -> bytes:
    """[[x, x], [x, x]] ... ``levels`` deep through the memo: 2**levels leaves, ~9 bytes a level."""
    out = P.EMPTY_LIST + P.BINPUT + b"\x00" + P.POP
    for i in range(levels):
        get = P.BINGET + bytes([i])
        out += P.EMPTY_LIST + P.MARK + get + get + P.APPENDS + P.BINPUT + bytes([i + 1]) + P.POP
    return out + P.BINGET + bytes([levels])


def laughs_tuple(levels: int) -> bytes:
    out = P.EMPTY_TUPLE + P.BINPUT + b"\x00" + P.POP
    for i in range(levels):
        get = P.BINGET + bytes([i])
        out += get + get + P.TUPLE2 + P.BINPUT + bytes([i + 1]) + P.POP
    return out + P.BINGET + bytes([levels])


def _patch_sizes(path: str, member: str, size: int) -> None:
    """Rewrite the declared uncompressed size of ``member`` in both zip headers."""
    raw = bytearray(open(path, "rb").read())
    name = member.encode()
    i = 0
    while (i := raw.find(b"PK\x03\x04", i)) >= 0:
        n = struct.unpack_from("<H", raw, i + 26)[0]
        if raw[i + 30 : i + 30 + n] == name:
            struct.pack_into("<I", raw, i + 22, size)
        i += 4
    i = 0
    while (i := raw.find(b"PK\x01\x02", i)) >= 0:
        n = struct.unpack_from("<H", raw, i + 28)[0]
        if raw[i + 46 : i + 46 + n] == name:
            struct.pack_into("<I", raw, i + 24, size)
        i += 4
    open(path, "wb").write(bytes(raw))


def _deflated_pt(tmp_path, payload: bytes, numel: int) -> str:
    p = str(tmp_path / "deflated.pt")
    pkl = prog(tensor("ByteStorage", "0", numel, 0, (numel,), (1,)))
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", payload, compress_type=zipfile.ZIP_DEFLATED)
    return p


def _case_laughs_list(tmp_path):
    return write_pt(tmp_path / "laughs.pt", prog(laughs(100))), "billion laughs"


def _case_laughs_in_dict_value(tmp_path):
    body = P.EMPTY_DICT + D("ds_version") + laughs(90) + P.SETITEM
    return write_pt(tmp_path / "ds_version.pt", prog(body)), "billion laughs"


def _case_laughs_tuple_as_key(tmp_path):
    body = P.EMPTY_DICT + laughs_tuple(90) + D(1) + P.SETITEM
    return write_pt(tmp_path / "key.pt", prog(body)), "not a scalar or a flat tuple"


def _case_laughs_tuple_in_set(tmp_path):
    body = G("builtins", "set") + P.EMPTY_LIST + laughs_tuple(90) + P.APPEND + P.TUPLE1 + P.REDUCE
    return write_pt(tmp_path / "set.pt", prog(body)), "not a scalar or a flat tuple"


def _case_laughs_in_error_args(tmp_path):
    # a refused call whose arguments are 2**90 leaves: the error message must stay short
    body = G("builtins", "slice") + laughs(90) + P.TUPLE1 + P.REDUCE
    return write_pt(tmp_path / "args.pt", prog(body)), "bad slice args"


def _case_self_containing_list(tmp_path):
    body = P.EMPTY_LIST + P.BINPUT + b"\x00" + P.BINGET + b"\x00" + P.APPEND
    return write_pt(tmp_path / "cycle.pt", prog(body)), "contains itself"


def _case_deep_nesting(tmp_path):
    body = P.EMPTY_LIST * 5000 + P.APPEND * 4999
    return write_pt(tmp_path / "deep.pt", prog(body)), "nests deeper"


def _case_stride0_8gib(tmp_path):
    pkl = prog(tensor("FloatStorage", "0", 1, 0, (1 << 31,), (0,)))
    return write_pt(tmp_path / "stride0.pt", pkl, {"0": b"\0" * 4}), "stride-0 or overlapping"


def _case_overlapping_strides(tmp_path):
    pkl = prog(tensor("FloatStorage", "0", 31, 0, (16, 16), (1, 1)))
    return write_pt(tmp_path / "overlap.pt", pkl, {"0": b"\0" * 124}), "stride-0 or overlapping"


def _case_deflate_declares_3gib(tmp_path):
    p = _deflated_pt(tmp_path, b"\0" * (1 << 20), 1 << 20)
    _patch_sizes(p, "archive/data/0", 3 << 30)
    return p, f"compressed members above {MAX_COMPRESSED_MEMBER} bytes are refused"


def _case_deflate_expands_past_declared(tmp_path):
    p = _deflated_pt(tmp_path, b"\0" * (64 << 20), 1024)
    _patch_sizes(p, "archive/data/0", 1024)
    return p, "expands beyond its declared 1024 bytes"


def _case_deflate_corrupt_crc(tmp_path):
    p = _deflated_pt(tmp_path, bytes(range(256)) * 16, 4096)
    raw = bytearray(open(p, "rb").read())
    i = raw.rindex(b"PK\x01\x02")  # the last central entry: archive/data/0
    struct.pack_into("<I", raw, i + 16, struct.unpack_from("<I", raw, i + 16)[0] ^ 1)
    open(p, "wb").write(bytes(raw))
    return p, "CRC-32 mismatch"


def _case_ordered_dict_get(tmp_path):
    body = (
        G("collections", "OrderedDict")
        + P.EMPTY_TUPLE
        + P.REDUCE
        + P.EMPTY_DICT
        + D("get")
        + D(3)
        + P.SETITEM
        + P.BUILD
    )
    return write_pt(tmp_path / "od_get.pt", prog(body)), "refusing attribute 'get'"


def _case_standin_shadows_method(tmp_path):
    body = G("m", "Thing") + P.EMPTY_TUPLE + P.NEWOBJ + P.EMPTY_DICT
    body += D("_set_attrs") + D(1) + P.SETITEM + P.BUILD
    return write_pt(tmp_path / "shadow.pt", prog(body)), "refusing attribute '_set_attrs'"


def _case_flipped_storage_byte(tmp_path):
    src = os.path.join(FIXTURES, "deepspeed", "z2_fp32_dp2", "ckpt")
    path = next(
        os.path.join(d, f)
        for d, _, fs in os.walk(src)
        for f in sorted(fs)
        if f.endswith("optim_states.pt")
    )
    raw = bytearray(open(path, "rb").read())
    raw[raw.index(b"data/0") + 300] ^= 0x01
    p = tmp_path / "flipped_optim_states.pt"
    p.write_bytes(bytes(raw))
    return str(p), "CRC-32 mismatch"


CASES = {
    f.__name__[len("_case_") :]: f
    for f in list(globals().values())
    if callable(f) and getattr(f, "__name__", "").startswith("_case_")
}


EXTRA = {"m.Thing": standin_class("m.Thing")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_torch_file_is_refused_fast(tmp_path, name):
    path, message = CASES[name](tmp_path)
    from jax_ucp._src.importers.deepspeed.files import DS_CLASSES

    error, lines = python_lines(load_torch_file, path, {**DS_CLASSES, **EXTRA})
    assert isinstance(error, TorchFileError), error
    assert message in str(error), str(error)
    assert os.path.basename(path) in str(error)
    assert len(str(error)) < 2000  # reprs are cut before they are built
    assert lines < 10**6, lines  # bounded work (measured at most 123251, deep_nesting)


@pytest.mark.timeout(60)
def test_short_repr_is_bounded_on_shared_structures():
    x: list = []
    for _ in range(200):
        x = [x, x]
    assert len(short_repr(x)) <= 200
    assert short_repr(np.zeros((3, 4), np.float32)) == "<array (3, 4) float32>"


@pytest.mark.timeout(60)
def test_deflated_member_within_limits_reads_exactly(tmp_path):
    data = np.arange(1000, dtype=np.uint8).tobytes()
    p = _deflated_pt(tmp_path, data, len(data))
    assert load_torch_file(p).tobytes() == data


@pytest.mark.timeout(60)
def test_shared_references_of_real_size_still_load(tmp_path):
    # sharing itself is legal (torch shares storages and dtypes): only expansion is bounded
    body = laughs(10)  # 1024 leaves
    assert len(load_torch_file(write_pt(tmp_path / "ok.pt", prog(body)))) == 2


@pytest.mark.timeout(60)
def test_corrupt_file_in_a_deepspeed_checkpoint_stops_convert(tmp_path):
    from jax_ucp.format import UCPError

    src = tmp_path / "src"
    shutil.copytree(os.path.join(FIXTURES, "deepspeed", "z2_fp32_dp2", "ckpt"), src)
    optim = sorted(src.rglob("*optim_states.pt"))[0]
    raw = bytearray(optim.read_bytes())
    raw[raw.index(b"data/0") + 300] ^= 0x01
    optim.write_bytes(bytes(raw))
    with pytest.raises(UCPError, match="CRC-32 mismatch") as err:
        jax_ucp.convert(str(src), str(tmp_path / "dst"))
    assert optim.name in str(err.value)
    assert not (tmp_path / "dst").exists()
    assert zlib  # imported for the deflate helpers' clarity


@pytest.mark.timeout(60)
def test_expansion_bound_grows_with_the_pickle():
    """The bound is max(4M, 2 per pickle byte): a big real file (a large model's DCP .metadata)
    is never refused for its size, a tiny one for its expansion."""
    from jax_ucp._src.torchfiles.allow_list import TorchFileError as Refused
    from jax_ucp._src.torchfiles.pickle_format import check_expansion

    flat = list(range(3_000_000))
    check_expansion([flat, flat], "big.pt", pickle_bytes=12_000_000)  # 6M <= 24M: accepted
    with pytest.raises(Refused, match="billion laughs"):
        check_expansion([flat, flat], "small.pt", pickle_bytes=1_000)


# Reading torch files a user hands over, bounded in total and safe against files that change
# underneath (issue 30, round 3): a zip of many deflated members, each under the per-member cap, is
# bounded by what the pickle declares and by one total for the archive (peak memory measured in a
# subprocess, by the process itself); a file truncated between planning and reading is an error
# naming it, never SIGBUS. Every hostile file is built here, without torch.


MIB = 1 << 20


def _deflated_zeros(size: int) -> tuple[bytes, int]:
    """A raw deflate stream of ``size`` zero bytes and their CRC-32, built in 1 MiB steps."""
    assert size % MIB == 0
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = bytes(MIB)
    out, crc = [], 0
    for _ in range(size // MIB):
        out.append(z.compress(block))
        crc = zlib.crc32(block, crc)
    out.append(z.flush())
    return b"".join(out), crc


def _zip(path, members: list[tuple[str, bytes, int, int, int]]) -> str:
    """A zip written byte by byte: ``(name, data, method, crc, uncompressed size)`` per member,
    so one compressed stream serves many members (zipfile would compress each again)."""
    central, offset = [], 0
    with open(path, "wb") as f:
        for name, data, method, crc, size in members:
            n = name.encode()
            header = struct.pack(
                "<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(data), size, len(n), 0
            )
            f.write(header + n + data)
            central.append(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    20,
                    20,
                    0,
                    method,
                    0,
                    0x21,
                    crc,
                    len(data),
                    size,
                    len(n),
                    0,
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
                + n
            )
            offset += len(header) + len(n) + len(data)
        directory = b"".join(central)
        f.write(directory)
        f.write(
            struct.pack(
                "<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(directory), offset, 0
            )
        )
    return str(path)


def _stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
    return name, data, 0, zlib.crc32(data), len(data)


def _bomb(path, members: int, member_bytes: int, declared: int) -> str:
    """``members`` deflated members of ``member_bytes`` zeros each (one 255 MiB stream is
    ~250 KB), the pickle a dict of uint8 tensors each declaring ``declared`` bytes."""
    data, crc = _deflated_zeros(member_bytes)
    body = b"}" + b"".join(
        D(f"t{i}") + tensor("ByteStorage", str(i), declared, 0, (declared,), (1,)) + b"s"
        for i in range(members)
    )
    return _zip(
        path,
        [
            _stored("archive/data.pkl", prog(body)),
            _stored("archive/byteorder", b"little"),
            *[(f"archive/data/{i}", data, 8, crc, member_bytes) for i in range(members)],
            _stored("archive/version", b"3\n"),
        ],
    )


_CONVERT_AND_MEASURE = """
import json, sys
import jax_ucp
try:
    jax_ucp.convert(sys.argv[1], sys.argv[2])
    error = None
except jax_ucp.UCPError as e:
    error = str(e)
# VmHWM, not ru_maxrss: the latter keeps the high-water mark of the process that forked this
# one (a pytest worker that ran other tests), VmHWM is this program's own memory since exec.
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"error": error, "peak": int(hwm.split()[1]) * 1024}))
"""


def _convert_in_subprocess(src, dst) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT_AND_MEASURE, str(src), str(dst)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_sixteen_deflated_members_each_under_the_cap_stay_bounded_in_total(tmp_path):
    """16 deflated members of 255 MiB of zeros (each under the 256 MiB per-member cap; 4 GiB in
    all from a ~4 MB file) declared as 16 tensors: refused once the archive's inflated total
    would pass MAX_INFLATED_TOTAL, with the process's own peak RSS far below what it declares
    (it reached 4.6 GB before)."""
    src = _bomb(tmp_path / "bomb.pt", 16, 255 * MIB, 255 * MIB)
    assert os.path.getsize(src) < 8 * MIB
    result = _convert_in_subprocess(src, tmp_path / "out")
    assert result["error"] is not None, "the bomb converted"
    assert "bomb.pt" in result["error"]
    assert f"more than the {MAX_INFLATED_TOTAL} bytes inflated in total" in result["error"]
    assert result["peak"] < 1 << 30, result
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(180)
def test_deflated_member_larger_than_its_storage_is_refused_before_inflating(tmp_path):
    """The pickle declares 16 bytes per storage, each member inflates to 255 MiB: refused by what
    the pickle declares, before any member is inflated (peak memory: the interpreter's)."""
    src = _bomb(tmp_path / "small_storages.pt", 16, 255 * MIB, 16)
    result = _convert_in_subprocess(src, tmp_path / "out")
    assert "small_storages.pt" in (result["error"] or "")
    assert "declares 267386880 bytes, but the pickle's storage needs 16" in result["error"]
    assert result["peak"] < 1 << 30, result


@pytest.mark.timeout(180)
def test_deflated_members_within_the_total_read_exactly(tmp_path):
    """Legitimate compressed archives under the total still load, byte for byte, and a CRC
    check of every member keeps nothing inflated."""
    src = _bomb(tmp_path / "ok.pt", 3, 4 * MIB, 4 * MIB)
    loaded = load_torch_file(src, verify_crc=True)
    assert sorted(loaded) == ["t0", "t1", "t2"]
    assert all(v.shape == (4 * MIB,) and not v.any() for v in loaded.values())


@pytest.mark.timeout(180)
def test_verify_crc_of_deflated_members_keeps_nothing(tmp_path):
    """verify_crc inflates an unreferenced deflated member only to check it: 2 x 255 MiB pass
    the check without counting against the archive's total (nothing is kept)."""
    from jax_ucp._src.torchfiles.torch_zip import TorchArchive

    src = _bomb(tmp_path / "unreferenced.pt", 2, 255 * MIB, 0)
    arch = TorchArchive(LocalDirectory(str(tmp_path)), "unreferenced.pt")
    try:
        arch.verify_crc()
        assert arch._inflated == 0
    finally:
        arch.close()
    with pytest.raises(TorchFileError, match="but the pickle's storage needs 0"):
        load_torch_file(src)


# Hostile inputs, each built here: a clear error naming the file, or an exact import.


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

    from jax_ucp._src.torchfiles.allow_list import TorchFileError
    from jax_ucp._src.torchfiles.pickle_format import restricted_loads

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


def test_lazy_crc_checks_a_storage_when_its_bytes_are_first_read(tmp_path):
    """``lazy_crc``: a damaged storage loads (its bytes are not read yet) but its first read is
    refused with the CRC-32 mismatch; the other storages read exactly; an eager load refuses
    the file at once; ``verify_crc`` runs the checks left."""
    from jax_ucp._src.format import mapped_file
    from jax_ucp._src.importers.deepspeed import DS_CLASSES
    from jax_ucp._src.torchfiles.torch_zip import TorchArchive

    real = os.path.join(FIX, "z1_fp32_dp2", "ckpt", "global_step2")
    real = os.path.join(real, "zero_pp_rank_0_mp_rank_00_optim_states.pt")  # several storages
    src = bytearray(open(real, "rb").read())
    with zipfile.ZipFile(real) as z:  # the damaged member's bytes: [start, end)
        info = next(m for m in z.infolist() if m.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack(
        "<HH", src[info.header_offset + 26 : info.header_offset + 30]
    )
    start = info.header_offset + 30 + name_len + extra_len
    end = start + info.file_size
    i = (start + end) // 2
    src[i] ^= 0xFF
    p = tmp_path / "flip.pt"
    p.write_bytes(bytes(src))
    with pytest.raises(TorchFileError, match=r"flip.pt.*CRC"):
        load_torch_file(p, DS_CLASSES)
    good = load_torch_file(real, DS_CLASSES)
    arch = TorchArchive(LocalDirectory(str(tmp_path)), "flip.pt", lazy_crc=True)
    loaded = arch.load(DS_CLASSES)
    arch.close()

    def arrays(x, at=""):
        if isinstance(x, np.ndarray):
            yield at, x
        elif isinstance(x, dict):
            for k, v in x.items():
                yield from arrays(v, f"{at}.{k}")
        elif isinstance(x, (list, tuple)):
            for k, v in enumerate(x):
                yield from arrays(v, f"{at}.{k}")

    want = dict(arrays(good))
    refused = []
    for at, arr in arrays(loaded):
        if not arr.size:
            continue
        _, offset = mapped_file.mapped_at(arr)
        if start <= offset < end:  # a tensor of the damaged storage (several may share it)
            for _ in range(2):
                with pytest.raises(TorchFileError, match=r"flip.pt: member '.*data/0'.*CRC-32"):
                    mapped_file.read_out(arr)
            refused.append(at)
        else:
            assert np.array_equal(mapped_file.read_out(arr).view(np.uint8), want[at].view(np.uint8))
    assert refused and len(refused) < len(want)
    arch = TorchArchive(LocalDirectory(str(tmp_path)), "flip.pt", lazy_crc=True)
    try:
        arch.load(DS_CLASSES)
        with pytest.raises(TorchFileError, match=r"flip.pt.*CRC"):
            arch.verify_crc()
    finally:
        arch.close()


def test_a_member_present_twice_is_refused(tmp_path):
    """A second ``archive/data/0`` with other bytes: torch.load reads the first copy, a lookup
    by name the last; which one is the tensor is not chosen, the file is refused naming it."""
    first = {"0": np.ones(4, np.float32).tobytes()}
    p = write_pt(tmp_path / "twice.pt", prog(tensor("FloatStorage", "0", 4, 0, (4,), (1,))), first)
    with zipfile.ZipFile(p, "a") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("archive/data/0", np.full(4, 2.0, np.float32).tobytes())
    with pytest.raises(TorchFileError, match=r"twice\.pt: .*present twice: 'archive/data/0'"):
        load_torch_file(p)


def test_one_storage_referenced_as_two_types_is_refused(tmp_path):
    """Storage ``0`` as FloatStorage and again as IntStorage: torch.save never writes it, and
    torch.load would type both by the first reference; the bytes are not read twice ways."""
    pkl = prog(
        P.MARK,
        tensor("FloatStorage", "0", 4, 0, (4,), (1,)),
        tensor("IntStorage", "0", 4, 0, (4,), (1,)),
        P.TUPLE,
    )
    p = write_pt(tmp_path / "types.pt", pkl, {"0": np.arange(4, dtype=np.float32).tobytes()})
    with pytest.raises(TorchFileError, match=r"types\.pt: storage '0' is referenced as float32"):
        load_torch_file(p)
