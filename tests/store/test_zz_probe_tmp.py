import time, numpy as np, jax, pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ucp
from jax_ucp._src.store.storage import object_store
pytestmark = pytest.mark.timeout(300)
def _mesh(shape):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("x", "y"))
def attempt(name, url, w, v, restore_kwargs={}):
    try:
        out = jax_ucp.restore(url, **restore_kwargs)
        ok = np.asarray(out["w"]).tobytes() == w.tobytes() and np.asarray(out["v"]).tobytes() == v.tobytes()
        print(f"\n[{name}] RESTORED exact={ok}")
    except Exception as e:
        print(f"\n[{name}] {type(e).__name__}: {str(e)[:300]}")
    try:
        print(f"[{name}] verify: {[m for _, m in jax_ucp.verify(url)][:2]}")
    except Exception as e:
        print(f"[{name}] verify raised {type(e).__name__}: {str(e)[:200]}")
def test_probe(bucket):
    _, root = bucket
    w = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    v = -np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    def fresh(tag):
        url = f"{root}/{tag}-{time.time_ns()}"
        sh = NamedSharding(_mesh((2, 4)), P("x", "y"))
        jax_ucp.save(url, {"w": jax.device_put(w, sh), "v": jax.device_put(v, sh)})
        es = {e.name: e for e in jax_ucp.inspect(url).tensors}
        return url, es["w"].dir, es["v"].dir
    tgt = {"w": NamedSharding(_mesh((4, 2)), P("y", "x")), "v": NamedSharding(_mesh((4, 2)), P("y", "x"))}
    for kind in ["truncate", "truncate_index", "append", "flip_data", "flip_crc", "flip_index", "swap_other_array", "index_wrong_len", "empty"]:
        url, wd, vd = fresh(kind)
        key = f"{wd}/c/0/0"
        data = object_store.read(url, key, 1 << 20)
        if kind == "truncate": new = data[:len(data) // 2]
        elif kind == "truncate_index": new = data[:-3]
        elif kind == "append": new = data + b"\0" * 16
        elif kind == "flip_data": new = data[:100] + bytes([data[100] ^ 1]) + data[101:]
        elif kind == "flip_crc": i = len(data) - 4 - 16 * 1 - 5; new = data[:i] + bytes([data[i] ^ 1]) + data[i+1:]
        elif kind == "flip_index": i = len(data) - 10; new = data[:i] + bytes([data[i] ^ 0x10]) + data[i+1:]
        elif kind == "swap_other_array":
            other = object_store.read(url, f"{vd}/c/0/0", 1 << 20); new = other
        elif kind == "index_wrong_len": new = data[:-4-16] + data[-4:]
        elif kind == "empty": new = b""
        object_store.write(url, key, new)
        attempt(kind, url, w, v)
        attempt(kind + " (resharded)", url, w, v, {"shardings": tgt})
