"""Shared helpers for the Megatron tests (no torch)."""

from __future__ import annotations

import json
import re
import shutil
from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np

FIX = Path(__file__).parent / "fixtures" / "megatron"


def copy_megatron_fixture(name: str, tmp_path) -> Path:
    """A writable copy of tests/fixtures/megatron/<name> in ``tmp_path`` (bad-input tests
    damage it)."""
    dst = tmp_path / name.replace("/", "_")
    shutil.copytree(FIX / name, dst)
    return dst


def assert_megatron_refused(src, tmp_path, match: str, **options) -> None:
    """``convert(src, tmp_path / "out", importing=MegatronOptions(vocab_size=61))`` refused by
    the Megatron importer with a message matching ``match``, nothing left at ``out``."""
    from jax_ucp._src.importers.megatron import MegatronImportError, MegatronOptions
    from tests.ucp_testing import assert_convert_refused

    options = {"importing": MegatronOptions(vocab_size=61), **options}
    out = str(tmp_path / "out")
    assert_convert_refused(str(src), out, match, error=MegatronImportError, **options)


#: megatron-core 0.16's dp_reshardable save of the GPT, its param groups in its rank's object
DISTOPT = FIX / "mcore_versions" / "0.16.1" / "gpt_distopt_dp_reshardable"
#: the scheduler run's rates at its saved 8 samples (tools/fixtures/make_megatron_scheduler_
#: fixture.py printed them): what its scheduler set on the param groups
SAVED_LR, SAVED_WD = 0.009997734440724333, 0.0118
RANK_OBJECT = "optimizer.distributed.dp_group_idx_{}.optimizer/"


def scheduled_distopt(root, consistent: bool = True) -> Path:
    """DISTOPT at ``root`` with the scheduler run's common state (args, scheduler, iteration;
    its layout said as dp_reshardable) and, when ``consistent``, the rank object's groups as
    that scheduler set them: every record of one run (torch-free: ``tests/torch_edit.py``)."""
    from tests.torch_edit import edit_dcp_object, edit_torch_file

    shutil.copytree(DISTOPT, root)
    common = Path(root) / "common.pt"
    shutil.copyfile(FIX / "gpt_distopt_dp2_scheduler_synthetic.common.pt", common)

    def layout(tree):
        tree["optimizer"] = {"param_state_sharding_type": "dp_reshardable"}

    def as_scheduled(tree):
        for group in tree[0]["param_groups"]:
            group.update(lr=SAVED_LR, min_lr=0.001, weight_decay=SAVED_WD * group["wd_mult"])

    edit_torch_file(common, layout)
    if consistent:
        edit_dcp_object(root, RANK_OBJECT.format(0), as_scheduled)
    return Path(root)


def assert_untouched(dest) -> None:
    """A failed import left neither ``dest`` nor a temporary folder beside it."""
    assert not dest.exists()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(dest.name + ".")], (
        "temp left behind"
    )


VOCAB = 61

TORCH_DIST = [
    "gpt_tp2",
    "gpt_pp2",
    "llama_tp2",
    "llama_pp2",
    "moe_ep2",
    "moe_grouped_ep2",
    "gpt_distopt_dp2",
    "llama_distopt_bf16_tp2dp2",
]
LEGACY = [
    "legacy_gpt_tp2pp2_synthetic",
    "legacy_llama_tp2_synthetic",
    "legacy_gpt_lm_names_tp2_synthetic",
    "legacy_gpt_distopt_pp2dp2_synthetic",
    "legacy_moe_ep2_synthetic",
    "legacy_moe_grouped_ep2_synthetic",
]


@lru_cache(None)
def fixture_info() -> dict:
    return json.loads((FIX / "fixtures.json").read_text())


def reference_of(name: str) -> str:
    """The fixture whose reference files serve ``name`` (a legacy fixture's torch_dist twin,
    made by megatron-core from the same seed; checked bit-identical before deduplication)."""
    return fixture_info()[name].get("reference") or name


def load_reference(name: str) -> dict[str, np.ndarray]:
    """torch's DCP consolidation, committed as npz (bfloat16 stored as its uint16 bits)."""
    z = np.load(FIX / f"{reference_of(name)}.consolidated.npz")
    bf16 = set(z["__bfloat16_keys__"].tolist())
    return {
        k: (z[k].view(ml_dtypes.bfloat16) if k in bf16 else z[k])
        for k in z.files
        if k != "__bfloat16_keys__"
    }


_OLD = [
    ("self_attention.query_key_value.", "self_attention.linear_qkv."),
    ("self_attention.dense.", "self_attention.linear_proj."),
    ("post_attention_layernorm.", "pre_mlp_layernorm."),
    ("mlp.dense_h_to_4h.", "mlp.linear_fc1."),
    ("mlp.dense_4h_to_h.", "mlp.linear_fc2."),
]


def reference_name(name: str) -> tuple[str, int | None]:
    """A legacy per-layer name -> (torch_dist stacked name, layer index) in the reference.

    Written independently of the importer: megatron-core's sharded_state_dict_keys_map
    (input_layernorm -> linear_qkv.layer_norm_, pre_mlp_layernorm -> linear_fc1.layer_norm_) and
    Megatron-LM's older names."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
        if name.startswith("encoder."):
            name = "decoder." + name[len("encoder.") :]
            for a, b in _OLD:
                name = name.replace(a, b)
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not m:
        return name, None
    rest = (
        m.group(2)
        .replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
        .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
    )
    return "decoder.layers." + rest, int(m.group(1))


def reference_value(name: str, ref: dict[str, np.ndarray]) -> tuple[str, np.ndarray]:
    """(reference key, expected array) for an imported legacy name, from the torch_dist twin.

    MoE: ``local_experts.<global e>`` is expert e of the stacked ``experts.experts.*`` [L, E, ...];
    grouped-GEMM ``weight1`` [h, E*X] / ``weight2`` [E*ffn, h] are megatron-core's GroupedMLP
    buffers, used as ``view(E, h, X)`` / ``view(E, ffn, h)``: expert e's linear_fc1 is
    ``weight1.reshape(E, h, X)[e].T`` (GroupedMLP.sharded_state_dict)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.*)", name)
    if m:
        k = "decoder.layers.mlp.experts.experts." + m.group(3)
        return k, ref[k][int(m.group(1))][int(m.group(2))]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.weight([12])", name)
    if m:
        k = "decoder.layers.mlp.experts.experts." + (
            "linear_fc1.weight" if m.group(2) == "1" else "linear_fc2.weight"
        )
        per_expert = ref[k][int(m.group(1))]  # [E, out, in]
        flat = np.ascontiguousarray(
            per_expert.transpose(0, 2, 1)
        )  # [E, in, out]: the view's layout
        return k, flat.reshape(flat.shape[1], -1) if m.group(2) == "1" else flat.reshape(
            -1, flat.shape[2]
        )
    k, i = reference_name(name)
    return k, (ref[k] if i is None else ref[k][i])


def is_vocab(name: str) -> bool:
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight")


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_bit_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(bits(got), bits(want)), f"{what}: values differ"


def lm_config(name: str, **over):
    from jax_ucp.models import LMConfig

    f = fixture_info()[name]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=f["hidden_size"],
        num_layers=f["num_layers"],
        num_attention_heads=f["num_attention_heads"],
        ffn_hidden_size=f["ffn_hidden_size"],
        num_query_groups=f["num_query_groups"],
        normalization=f["normalization"],
        gated=f["gated"],
        bias=f["bias"],
        position=f["position"],
        tied=f["tied"],
        max_position_embeddings=32,
        num_experts=f.get("num_experts"),
    )
    kw.update(over)
    return LMConfig(**kw)


def load_optimizer_truth(name: str) -> dict[tuple[str, str], np.ndarray]:
    """{(kind, global name): array} gathered from every DP rank's optimizer shards when the
    fixture was made (kind: param / exp_avg / exp_avg_sq); tied copies under 'tied_copy/...'."""
    z = np.load(FIX / f"{name}.optimizer_truth.npz")
    out = {}
    for k in z.files:
        _rank, kind, rest = k.split("/", 2)
        out[(kind, rest)] = z[k]
    return out
