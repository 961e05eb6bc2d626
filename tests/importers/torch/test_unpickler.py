"""The torch-free restricted reader: tensors exact, hostile or broken files refused by name."""

from __future__ import annotations

import collections
import glob
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np
import pytest

from jax_ucp.importers.torch.unpickler import (
    StandIn,
    TorchFileError,
    UnsafePickleError,
    int_enum_standin,
    load_torch_file,
    restricted_loads,
    scan_globals,
    standin_class,
)
from tests.ucp_testing import REPO

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


def test_real_deepspeed_file_loads_and_scans():
    files = sorted(
        glob.glob(os.path.join(FIX, "z*_bf16_dp2", "ckpt", "global_step2", "*optim_states.pt"))
    )
    assert files, "DeepSpeed fixtures missing"
    g = scan_globals(files[0])
    assert "deepspeed.utils.tensor_fragment.fragment_address" in g
    with pytest.raises(UnsafePickleError, match="deepspeed"):
        load_torch_file(files[0])  # DeepSpeed classes are not in the base allow-list
    from jax_ucp.importers.deepspeed import DS_CLASSES

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
    with pytest.raises(UnsafePickleError, match=r"'os\.system'.*not in the allow-list"):
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
    with pytest.raises(TorchFileError, match="trunc.pt"):
        load_torch_file(p, __import__("jax_ucp.importers.deepspeed", fromlist=["x"]).DS_CLASSES)


def test_corrupt_pickle_and_non_torch_files(tmp_path):
    p = write_pt(tmp_path / "garbage.pt", b"\x80\x02garbage")
    with pytest.raises(TorchFileError, match="garbage.pt: corrupt pickle"):
        load_torch_file(p)
    p = write_pt(tmp_path / "nostop.pt", b"\x80\x02" + D([1, 2]))
    with pytest.raises(TorchFileError, match="nostop.pt"):
        load_torch_file(p)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(TorchFileError, match="empty.pt: file is empty"):
        load_torch_file(empty)
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"rest")
    with pytest.raises(TorchFileError, match="legacy.pt: legacy"):
        load_torch_file(legacy)
    text = tmp_path / "text.pt"
    text.write_text("hello")
    with pytest.raises(TorchFileError, match="not a torch zip"):
        load_torch_file(text)
    with pytest.raises(TorchFileError, match="nope.pt: cannot open"):
        load_torch_file(tmp_path / "nope.pt")
    z = tmp_path / "nodata.pt"
    with zipfile.ZipFile(z, "w") as f:
        f.writestr("x/other", "1")
    with pytest.raises(TorchFileError, match="data.pkl"):
        load_torch_file(z)


def test_corrupt_storage_bytes_detected_by_crc(tmp_path):
    src = bytearray(open(_real_file(), "rb").read())
    i = src.index(b"data/0") + 200  # inside the first storage's bytes
    src[i] ^= 0xFF
    p = tmp_path / "flip.pt"
    p.write_bytes(bytes(src))
    from jax_ucp.importers.deepspeed import DS_CLASSES

    with pytest.raises(TorchFileError, match="flip.pt.*CRC"):
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
