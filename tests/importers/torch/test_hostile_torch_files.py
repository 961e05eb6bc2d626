"""Hostile torch files: each a few hundred bytes to a few MB, each refused with a clear
TorchFileError within bounded time and memory (a hang is a failure: per-test timeout)."""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import time
import zipfile
import zlib

import numpy as np
import pytest

from jax_ucp.importers.torch.unpickler import (
    MAX_COMPRESSED_MEMBER,
    TorchFileError,
    load_torch_file,
    short_repr,
    standin_class,
)
from tests.importers.torch.test_unpickler import D, G, prog, tensor, write_pt
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(60)
P = pickle
FIX = os.path.join(REPO, "tests", "fixtures")


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
    src = os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt")
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


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_torch_file_is_refused_fast(tmp_path, name):
    path, message = CASES[name](tmp_path)
    from jax_ucp.importers.deepspeed.files import DS_CLASSES

    started = time.monotonic()
    with pytest.raises(TorchFileError) as err:
        load_torch_file(path, {**DS_CLASSES, **EXTRA})
    assert message in str(err.value), str(err.value)
    assert os.path.basename(path) in str(err.value)
    assert len(str(err.value)) < 2000  # reprs are cut before they are built
    assert time.monotonic() - started < 30  # generous: the timeout is the real guard


def test_short_repr_is_bounded_on_shared_structures():
    x: list = []
    for _ in range(200):
        x = [x, x]
    assert len(short_repr(x)) <= 200
    assert short_repr(np.zeros((3, 4), np.float32)) == "<array (3, 4) float32>"


def test_deflated_member_within_limits_reads_exactly(tmp_path):
    data = np.arange(1000, dtype=np.uint8).tobytes()
    p = _deflated_pt(tmp_path, data, len(data))
    assert load_torch_file(p).tobytes() == data


def test_shared_references_of_real_size_still_load(tmp_path):
    # sharing itself is legal (torch shares storages and dtypes): only expansion is bounded
    body = laughs(10)  # 1024 leaves
    assert len(load_torch_file(write_pt(tmp_path / "ok.pt", prog(body)))) == 2


def test_corrupt_file_in_a_deepspeed_checkpoint_stops_convert(tmp_path):
    import jax_ucp
    from jax_ucp.format import UCPError

    src = tmp_path / "src"
    shutil.copytree(os.path.join(FIX, "deepspeed", "z2_fp32_dp2", "ckpt"), src)
    optim = sorted(src.rglob("*optim_states.pt"))[0]
    raw = bytearray(optim.read_bytes())
    raw[raw.index(b"data/0") + 300] ^= 0x01
    optim.write_bytes(bytes(raw))
    with pytest.raises(UCPError, match="CRC-32 mismatch") as err:
        jax_ucp.convert(str(src), str(tmp_path / "dst"))
    assert optim.name in str(err.value)
    assert not (tmp_path / "dst").exists()
    assert zlib  # imported for the deflate helpers' clarity


def test_expansion_bound_grows_with_the_pickle():
    """The bound is max(4M, 2 per pickle byte): a big real file (a large model's DCP .metadata)
    is never refused for its size, a tiny one for its expansion."""
    from jax_ucp.importers.torch.unpickler import TorchFileError as Refused
    from jax_ucp.importers.torch.unpickler import check_expansion

    flat = list(range(3_000_000))
    check_expansion([flat, flat], "big.pt", pickle_bytes=12_000_000)  # 6M <= 24M: accepted
    with pytest.raises(Refused, match="billion laughs"):
        check_expansion([flat, flat], "small.pt", pickle_bytes=1_000)
