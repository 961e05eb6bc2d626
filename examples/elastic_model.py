"""A small GPT in flax + optax AdamW, a learnable synthetic task, and mesh-aware training.

Shared by ``examples/elastic_resume.py`` (the elastic-resume experiment) and the tests
(``tests/api/test_elastic_resume.py``, ``tests/language/test_structure_transforms.py``).

- ``GPTConfig`` / ``GPT``: pre-norm decoder-only transformer. Three parameter layouts of the same
  math: ``layout="layers"`` (``layers_0 … layers_{L-1}``), ``"scanned"`` (one ``layers`` subtree,
  every leaf stacked ``[L, …]``, ``nn.scan``) and ``"pipeline"`` (``stages`` subtree, every leaf
  ``[stages, L/stages, …]``, a scan of scans); and ``fused_qkv`` (one ``attn/qkv`` Dense
  ``[D, 3D]`` laid out ``[Q | K | V]``) or separate ``attn/{q,k,v}``.
- ``batch_at(seed, position, …)``: the global batch number ``position`` of a deterministic
  synthetic stream (each sequence walks a fixed permutation of the vocabulary, 10 % noise);
  the data position is just an integer saved in the checkpoint.
- ``param_spec`` / ``state_shardings``: Megatron-style TP (column/row parallel, vocab parallel)
  plus FSDP, for a mesh with axes ``("data", "fsdp", "tp")``; the batch is split over
  ``("data", "fsdp")``.
- ``make_train_step``: jitted AdamW step with explicit in/out shardings (state donated).
- ``fingerprint``: sha256 of every leaf's global bytes (gathered across processes if needed).
- ``layout_spec(src_cfg, dst_cfg)``: the UCP-language spec restoring a checkpoint of one
  layout into another (per-layer ⇄ scanned ⇄ pipeline with any stage count, fused ⇄ separate
  QKV); ``convert_flat`` does the same conversion in plain numpy (the tests' oracle).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    seq_len: int = 32  # tokens per sample fed to the model (the sample has seq_len + 1)
    layout: str = "layers"  # "layers" | "scanned" | "pipeline"
    stages: int = 1  # pipeline stages (layout="pipeline")
    fused_qkv: bool = True

    def __post_init__(self):
        if self.layout not in ("layers", "scanned", "pipeline"):
            raise ValueError(f"layout must be layers/scanned/pipeline, got {self.layout!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.layout == "pipeline" and self.n_layers % self.stages:
            raise ValueError(f"n_layers={self.n_layers} is not divisible by stages={self.stages}")


# ------------------------------------------------------------------------------------ model


class Attention(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, s, d = x.shape
        hd = d // c.n_heads
        if c.fused_qkv:
            qkv = nn.Dense(3 * d, name="qkv")(x)
            q, k, v = jnp.split(qkv, 3, axis=-1)
        else:
            q, k, v = (nn.Dense(d, name=n)(x) for n in ("q", "k", "v"))
        q, k, v = (t.reshape(b, s, c.n_heads, hd) for t in (q, k, v))
        sc = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(np.float32)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, jnp.finfo(sc.dtype).min)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(sc, axis=-1), v).reshape(b, s, d)
        return nn.Dense(d, name="proj")(ctx)


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, _=None):
        c = self.cfg
        x = x + Attention(c, name="attn")(nn.LayerNorm(name="ln_1")(x))
        h = nn.LayerNorm(name="ln_2")(x)
        h = nn.Dense(c.d_ff, name="fc1")(h)
        h = nn.Dense(c.d_model, name="fc2")(jax.nn.gelu(h))
        return x + h, None


class Stage(nn.Module):
    """L/stages blocks, scanned (one pipeline stage)."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x, _=None):
        n = self.cfg.n_layers // self.cfg.stages
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=n)
        x, _ = blocks(self.cfg, name="layers")(x, None)
        return x, None


class GPT(nn.Module):
    """tokens [b, s] int32 -> logits [b, s, vocab]."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, name="wte")(tokens)
        x = x + nn.Embed(c.seq_len, c.d_model, name="wpe")(jnp.arange(tokens.shape[1]))[None]
        if c.layout == "layers":
            for i in range(c.n_layers):
                x, _ = Block(c, name=f"layers_{i}")(x)
        elif c.layout == "scanned":
            blocks = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.n_layers
            )
            x, _ = blocks(c, name="layers")(x, None)
        else:
            stages = nn.scan(
                Stage, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.stages
            )
            x, _ = stages(c, name="stages")(x, None)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(c.vocab, name="lm_head")(x)


def init_params(cfg: GPTConfig, seed: int = 0):
    return GPT(cfg).init(jax.random.key(seed), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]


def make_optimizer(
    lr: float = 3e-3, warmup: int = 10, total: int = 1000, weight_decay: float = 0.1
):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), lr * 0.1)
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.99, weight_decay=weight_decay)
    )


def loss_fn(model, params, batch):
    logits = model.apply({"params": params}, batch[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
    return nll.mean()


# ------------------------------------------------------------------------------------- data


def batch_at(
    seed: int, position: int, global_batch: int, seq_len: int, vocab: int, noise: float = 0.1
) -> np.ndarray:
    """Global batch number ``position``: [global_batch, seq_len + 1] int32.

    Each sample walks a fixed random permutation of the vocabulary (x[t+1] = perm[x[t]], one
    permutation per seed) from a random start; each token is replaced by a uniform random one
    with probability ``noise``. Learnable (the optimum loss is about the noise entropy, ~0.75
    nats for noise 0.1 and vocab 64). Deterministic in (seed, position) only, so every process
    builds the same global batch and a resumed run continues the stream exactly.
    """
    perm = np.random.default_rng([seed, 2**31 - 1]).permutation(vocab)
    rng = np.random.default_rng([seed, position])
    x = np.empty((global_batch, seq_len + 1), np.int64)
    x[:, 0] = rng.integers(0, vocab, global_batch)
    flip = rng.random((global_batch, seq_len + 1)) < noise
    rand = rng.integers(0, vocab, (global_batch, seq_len + 1))
    for t in range(1, seq_len + 1):
        x[:, t] = np.where(flip[:, t], rand[:, t], perm[x[:, t - 1]])
    return x.astype(np.int32)


# --------------------------------------------------------------------------------- sharding

# Megatron-style tensor parallelism (column-parallel in, row-parallel out, vocab-parallel
# embedding) + FSDP on the other dimension. Rules match the path *after* any stacked
# (scanned / pipeline) leading dimensions, which stay unsharded.
_RULES = [
    (r"wte/embedding", ("tp", "fsdp")),
    (r"wpe/embedding", (None, "fsdp")),
    (r".*attn/(qkv|q|k|v)/kernel", ("fsdp", "tp")),
    (r".*attn/(qkv|q|k|v)/bias", ("tp",)),
    (r".*attn/proj/kernel", ("tp", "fsdp")),
    (r".*fc1/kernel", ("fsdp", "tp")),
    (r".*fc1/bias", ("tp",)),
    (r".*fc2/kernel", ("tp", "fsdp")),
    (r"lm_head/kernel", ("fsdp", "tp")),
    (r"lm_head/bias", ("tp",)),
]


def _path_str(path) -> str:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        else:
            out.append(str(k))
    return "/".join(out)


def param_spec(name: str, shape: tuple, mesh: Mesh) -> P:
    """PartitionSpec for a parameter (or moment) named ``name`` relative to the params root."""
    lead = 0
    if name.startswith("layers/"):
        lead = 1
    elif name.startswith("stages/"):
        lead = 2
    spec: tuple = ()
    for pat, s in _RULES:
        if re.fullmatch(pat, name):
            spec = s
            break
    spec = (None,) * lead + tuple(spec)
    # an axis that does not divide its dimension (or is absent from the mesh) is replicated
    fixed = []
    for dim, ax in zip(shape, spec + (None,) * (len(shape) - len(spec))):
        if ax is not None and (ax not in mesh.shape or dim % mesh.shape[ax]):
            ax = None
        fixed.append(ax)
    return P(*fixed)


def state_shardings(abstract_state, mesh: Mesh):
    """NamedShardings for {"params", "opt_state"}: moments follow their parameter; scalars
    (counts) are replicated."""

    def one(path, leaf):
        parts = _path_str(path).split("/")
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            return NamedSharding(mesh, P())
        if parts[0] == "params":
            rel = parts[1:]
        else:  # opt_state/<chain idx...>/<mu|nu>/<param path>
            idx = next((i for i, p in enumerate(parts) if p in ("mu", "nu")), None)
            rel = parts[idx + 1 :] if idx is not None else parts
        return NamedSharding(mesh, param_spec("/".join(rel), shape, mesh))

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def make_mesh(shape, devices=None) -> Mesh:
    devs = np.array(jax.devices() if devices is None else devices)
    if devs.size != int(np.prod(shape)):
        raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, have {devs.size}")
    return Mesh(devs.reshape(shape), MESH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, None))


def device_batch(host_batch: np.ndarray, mesh: Mesh) -> jax.Array:
    """The global batch as a jax.Array; each process places only its own slices."""
    s = batch_sharding(mesh)
    return jax.make_array_from_callback(host_batch.shape, s, lambda idx: host_batch[idx])


# ------------------------------------------------------------------------------ train state


def abstract_state(cfg: GPTConfig, tx, mesh: Mesh):
    """{"params", "opt_state"} as ShapeDtypeStructs carrying their shardings on ``mesh``."""
    shapes = jax.eval_shape(
        lambda: (lambda p: {"params": p, "opt_state": tx.init(p)})(init_params(cfg))
    )
    sh = state_shardings(shapes, mesh)
    return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes, sh)


def init_state(cfg: GPTConfig, tx, mesh: Mesh, seed: int = 0):
    abstract = abstract_state(cfg, tx, mesh)
    sh = jax.tree.map(lambda a: a.sharding, abstract)

    def init():
        p = init_params(cfg, seed)
        return {"params": p, "opt_state": tx.init(p)}

    return jax.jit(init, out_shardings=sh)()


def make_train_step(cfg: GPTConfig, tx, mesh: Mesh, abstract):
    model = GPT(cfg)
    sh = jax.tree.map(lambda a: a.sharding, abstract)

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, loss

    return jax.jit(
        step,
        in_shardings=(sh, batch_sharding(mesh)),
        out_shardings=(sh, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


# ----------------------------------------------------------------------------- fingerprints


def to_host(x) -> np.ndarray:
    """Global value of an array on the host (allgathered when spread over processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def fingerprint(tree) -> dict[str, str]:
    """{path: sha256 of dtype, shape and raw bytes} for every array leaf."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.ascontiguousarray(to_host(leaf))
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.view(np.uint8).tobytes() if a.size else b"")
        out[_path_str(path)] = h.hexdigest()
    return out


def scalar(x) -> float:
    """A replicated scalar jax.Array as a Python float (also when spread over processes)."""
    return float(np.asarray(x.addressable_data(0)))


# ------------------------------------------------------------------- layout changes (UCP language)


def _get(c, k):
    return c[k] if isinstance(c, dict) else getattr(c, k)


def layout_spec(src, dst, *, name: str = ""):
    """A UCP-language spec restoring a checkpoint of model ``src`` into model ``dst``.

    ``src``/``dst``: ``GPTConfig`` (or dicts with ``layout``, ``stages``, ``fused_qkv``,
    ``n_heads``, ``d_model``). Any layout to any layout (per-layer ``layers_i`` ⇄ scanned
    ``layers`` [L, …] ⇄ pipeline ``stages/layers`` [S, L/S, …] with any S dividing L) and fused
    QKV ⇄ separate q/k/v, as lazy views at restore. Rules are written for parameter names only;
    the optimizer moments (``opt_state/**/mu``, ``nu``) follow through the spec's roots.
    """
    from jax_ucp.language import RestoreRule, Spec

    sl, dl = _get(src, "layout"), _get(dst, "layout")
    sf, df = _get(src, "fused_qkv"), _get(dst, "fused_qkv")
    # where block parameters live in the source, and how to reach "stacked [L, ...]" or
    # "one tensor per layer (variable i)"
    if sl == "layers":
        pre, per_layer, unify = r"layers_(?P<i>\d+)/", True, []
    elif sl == "scanned":
        pre, per_layer, unify = r"layers/", False, []
    else:
        pre, per_layer, unify = r"stages/layers/", False, [{"op": "ungroup_stages"}]
    if dl == "layers":
        tpre, place = "layers_{i}/", ([] if per_layer else [{"op": "unstack", "var": "i"}])
    elif dl == "scanned":
        tpre, place = "layers/", ([{"op": "stack", "over": "i"}] if per_layer else [])
    else:
        tpre = "stages/layers/"
        if sl == "pipeline":  # [S, L/S, ...] -> [S', L/S', ...] directly
            unify, place = [], [{"op": "regroup_stages", "stages": "pp"}]
        else:
            place = ([{"op": "stack", "over": "i"}] if per_layer else []) + [
                {"op": "group_stages", "stages": "pp"}
            ]
    rules = []
    if sf and not df:
        rules.append(
            RestoreRule(
                pre + r"attn/qkv/(?P<leaf>kernel|bias)",
                tpre + "attn/{part}/{leaf}",
                ops=tuple(unify + [{"op": "split_qkv", "axis": -1, "interleaved": False}] + place),
                label="fused qkv -> q, k, v",
            )
        )
    elif df and not sf:
        rules.append(
            RestoreRule(
                pre + r"attn/(?P<part>q|k|v)/(?P<leaf>kernel|bias)",
                tpre + "attn/qkv/{leaf}",
                ops=tuple(unify + [{"op": "merge_qkv", "axis": -1, "interleaved": False}] + place),
                label="q, k, v -> fused qkv",
            )
        )
    rules.append(
        RestoreRule(
            pre + r"(?P<rest>.+)",
            tpre + "{rest}",
            ops=tuple(unify + place),
            label=f"blocks: {sl} -> {dl}",
        )
    )
    rules.append(RestoreRule(r".+", label="everything else as is"))
    settings = {
        "num_attention_heads": _get(dst, "n_heads"),
        "head_dim": _get(dst, "d_model") // _get(dst, "n_heads"),
    }
    if dl == "pipeline":
        settings["pp"] = _get(dst, "stages")
    return Spec(
        name=name or f"{sl}{'+fused' if sf else ''} -> {dl}{'+fused' if df else ''}",
        settings=settings,
        restore=tuple(rules),
    )


# ------------------------------------------------- the same conversions in plain numpy (an oracle)


def to_blocks(params: dict, c) -> tuple[list, dict]:
    """Flat ``{"a/b": array}`` params of model ``c`` -> (per layer ``{rest: array}`` with separate
    q/k/v, the non-block params). Plain numpy; independent of the UCP language."""
    blocks, other = [dict() for _ in range(c.n_layers)], {}
    for k, a in params.items():
        if c.layout == "layers" and (m := re.fullmatch(r"layers_(\d+)/(.+)", k)):
            blocks[int(m[1])][m[2]] = a
        elif c.layout == "scanned" and (m := re.fullmatch(r"layers/(.+)", k)):
            for i in range(c.n_layers):
                blocks[i][m[1]] = a[i]
        elif c.layout == "pipeline" and (m := re.fullmatch(r"stages/layers/(.+)", k)):
            a = a.reshape((c.n_layers,) + a.shape[2:])
            for i in range(c.n_layers):
                blocks[i][m[1]] = a[i]
        else:
            other[k] = a
    if c.fused_qkv:
        for b in blocks:
            for leaf in ("kernel", "bias"):
                b.update(
                    zip(
                        [f"attn/{p}/{leaf}" for p in "qkv"],
                        np.split(b.pop(f"attn/qkv/{leaf}"), 3, axis=-1),
                    )
                )
    return blocks, other


def from_blocks(blocks, other, c) -> dict:
    blocks = [dict(b) for b in blocks]
    if c.fused_qkv:
        for b in blocks:
            for leaf in ("kernel", "bias"):
                b[f"attn/qkv/{leaf}"] = np.concatenate(
                    [b.pop(f"attn/{p}/{leaf}") for p in "qkv"], axis=-1
                )
    out = dict(other)
    for rest in blocks[0]:
        if c.layout == "layers":
            out.update({f"layers_{i}/{rest}": b[rest] for i, b in enumerate(blocks)})
        else:
            st = np.stack([b[rest] for b in blocks])
            if c.layout == "scanned":
                out[f"layers/{rest}"] = st
            else:
                out[f"stages/layers/{rest}"] = st.reshape(
                    (c.stages, c.n_layers // c.stages) + st.shape[1:]
                )
    return out


def flat_host(tree) -> dict:
    """``{"a/b/c": np.ndarray}`` of every array leaf (gathered across processes if needed)."""
    return {_path_str(p): to_host(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def convert_flat(flat: dict, src, dst) -> dict:
    """A flat ``{params, opt_state}`` of model ``src`` as model ``dst`` would hold it: params
    and every Adam moment subtree (``…/mu/…``, ``…/nu/…``) converted, the rest unchanged."""
    roots: dict = {}
    out = {}
    for k, v in flat.items():
        parts = k.split("/")
        cut = (
            1
            if parts[0] == "params"
            else next((i + 1 for i, p in enumerate(parts) if p in ("mu", "nu")), None)
        )
        if cut is None:
            out[k] = v
        else:
            roots.setdefault("/".join(parts[:cut]), {})["/".join(parts[cut:])] = v
    for root, sub in roots.items():
        out.update({f"{root}/{k}": v for k, v in from_blocks(*to_blocks(sub, src), dst).items()})
    return out
