"""Megatron importer against the committed fixtures (no torch needed).

Fixtures were written by megatron-core 0.16.1 itself on CPU (tools/fixtures/
make_megatron_fixtures.py); references are torch's own DCP consolidation and a plain-PyTorch
forward (itself checked against megatron-core's CPU forward when the fixtures were made).
"""

from __future__ import annotations

import os
import shutil
import struct
import zlib

import jax
import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import MegatronImportError, dcp, detect_megatron
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.conversion import ImportOptions, MegatronOptions, convert
from tests.megatron_testing import (
    FIX,
    LEGACY,
    TORCH_DIST,
    VOCAB,
    assert_bit_equal,
    assert_untouched,
    copy_megatron_fixture,
    fixture_info,
    is_vocab,
    lm_config,
    load_optimizer_truth,
    load_reference,
    reference_name,
    reference_of,
    reference_value,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert each fixture once per module (vocab padding stripped to the tokenizer's 61)."""
    root = tmp_path_factory.mktemp("megatron_ucp")
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = convert(
                FIX / name,
                root / name,
                format="megatron",
                importing=MegatronOptions(vocab_size=VOCAB),
            )
        return cache[name]

    return get


def test_fixtures_are_small_and_labelled():
    total = sum(f.stat().st_size for f in FIX.rglob("*") if f.is_file())
    # 4.5 MiB for megatron-core 0.16's fixtures, + 10 MiB for other releases and optimizer
    # layouts (0.13-0.16 x dp_reshardable, flattened, dp_zero_gather_scatter, with buckets),
    # + 9 MiB for MoE with the distributed optimizer (0.16, 0.19), 0.17-0.19 and singleton shards
    # (tiny models, but each torch_dist chunk is its own torch.save archive: ~0.5 MiB each),
    # + 1 MiB for 0.17/0.18 fully_reshardable and dp_zero_gather_scatter and 0.19 model-only,
    # + 1 MiB for 0.16 grouped-GEMM experts with the distributed optimizer (EP2, EP1),
    # + 0.4 MiB for 0.17/0.18 model-only (GPT TP2), + 1 MiB for 0.16 grouped-GEMM experts
    # fully_reshardable EP2 and dp_reshardable TP2 x EP2
    assert total <= 27.5 * 2**20, f"megatron fixtures take {total / 2**20:.2f} MiB"
    info = fixture_info()
    for name in LEGACY:
        assert "synthetic" in name and name in info
    fc = info["forward_check"]  # reference forward vs megatron-core's own CPU forward
    assert set(fc) == {"gpt", "llama", "moe"} and all(v["max_abs_diff"] < 1e-5 for v in fc.values())


@pytest.mark.parametrize("name", TORCH_DIST + LEGACY)
def test_detect(name):
    src = detect_megatron(LocalDirectory(str(FIX / name)))
    assert src is not None and src.format == ("legacy" if name in LEGACY else "torch_dist")


def test_detect_rejects_other_dirs(tmp_path):
    assert detect_megatron(LocalDirectory(str(tmp_path))) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MegatronImportError, match="not a Megatron checkpoint"):
        convert(empty, tmp_path / "out", format="megatron")


# ------------------------------------------------------------------ exactness vs torch DCP


@pytest.mark.parametrize("name", TORCH_DIST)
def test_dcp_reader_matches_torch_consolidation(name):
    """Every tensor the raw reader assembles equals dcp.load(..., no_dist=True), bit for bit."""
    ck = dcp.open_dcp(LocalDirectory(str(FIX / name)))
    ref = load_reference(name)
    assert set(ck.tensors) == set(ref)
    for n in ck.tensors:
        assert_bit_equal(ck.read(n), ref[n], n)
    assert ck.objects, "megatron-core writes _extra_state ShardedObjects"
    assert all(isinstance(ck.read_object(o), list) for o in list(ck.objects)[:2])


@pytest.mark.parametrize("name", TORCH_DIST)
def test_torch_dist_import_bit_exact(name, converted):
    d = converted(name)
    r = jax_ucp.restore(d)
    ref = load_reference(name)
    has_opt = any(k.startswith("optimizer.") for k in ref)
    model_names = [k for k in ref if not k.startswith("optimizer.")]
    assert sorted(r["params"]) == sorted(model_names)
    for k in model_names:
        strip = (lambda a: a[:VOCAB]) if is_vocab(k) else (lambda a: a)
        if has_opt:
            assert_bit_equal(
                r["params"][k], strip(ref[f"optimizer.state.param.{k}"]), f"params/{k}"
            )
            assert_bit_equal(
                r["opt_state"]["mu"][k], strip(ref[f"optimizer.state.exp_avg.{k}"]), f"mu/{k}"
            )
            assert_bit_equal(
                r["opt_state"]["nu"][k], strip(ref[f"optimizer.state.exp_avg_sq.{k}"]), f"nu/{k}"
            )
        else:
            assert_bit_equal(r["params"][k], strip(ref[k]), k)
        if "model_params" in r:
            assert_bit_equal(r["model_params"][k], strip(ref[k]), f"model_params/{k}")
    bf16 = any(v.dtype.name == "bfloat16" for k, v in ref.items() if not k.startswith("optimizer."))
    assert ("model_params" in r) == (has_opt and bf16)
    if has_opt:
        assert r["opt_state"]["count"].dtype == np.int32 and int(r["opt_state"]["count"]) == 2
    else:
        assert "opt_state" not in r


def test_stacked_layers_stay_stacked_and_padding_is_recorded(converted):
    d = converted("llama_tp2")
    r = jax_ucp.restore(d)
    assert r["params"]["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 64, 32)
    assert r["params"]["embedding.word_embeddings.weight"].shape == (VOCAB, 32)
    src = jax_ucp.inspect(d).source
    assert src["vocab_size"] == VOCAB and src["format"] == "torch_dist"
    assert src["vocab_stripped"]["embedding.word_embeddings.weight"] == [64, VOCAB]
    assert any("_extra_state" in o for o in src["skipped_objects"])


@pytest.mark.parametrize("name", ["moe_ep2", "moe_grouped_ep2"])
def test_moe_experts_global(name, converted):
    """Sequential and grouped-GEMM experts land in the same EP-invariant stacked layout."""
    r = jax_ucp.restore(converted(name))
    ref = load_reference(name)
    w = r["params"]["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert w.shape == (1, 4, 32, 32)  # [layers, experts (both EP ranks), 2*ffn, hidden]
    assert_bit_equal(w, ref["decoder.layers.mlp.experts.experts.linear_fc1.weight"], "experts")


def test_legacy_moe_expert_numbering(converted):
    r = jax_ucp.restore(converted("legacy_moe_ep2_synthetic"))
    got = sorted(
        int(k.split(".")[6])
        for k in r["params"]
        if ".local_experts." in k and k.endswith("fc1.weight")
    )
    assert got == [0, 1, 2, 3]  # EP rank 1's local experts 0, 1 became global 2, 3
    g = jax_ucp.restore(converted("legacy_moe_grouped_ep2_synthetic"))["params"]
    assert g["decoder.layers.0.mlp.experts.weight1"].shape == (32, 4 * 32)


def test_no_vocab_size_keeps_padding_and_says_so(tmp_path):
    d = convert(FIX / "gpt_tp2", tmp_path / "o", format="megatron")
    r = jax_ucp.restore(d)
    ref = load_reference("gpt_tp2")
    assert_bit_equal(r["params"]["output_layer.weight"], ref["output_layer.weight"], "padded")
    assert any("vocab padding kept" in n for n in jax_ucp.inspect(d).source["notes"])


def test_settings_give_the_padded_and_the_true_vocabulary():
    """Megatron-LM's args record padded_vocab_size only: LMConfig.from_settings says what is
    missing and how to give it; with vocab_size= both are recorded, megatron-core-only saves
    (no args) included, the padded one from the rows stripped."""
    import json

    from jax_ucp._src.importers.megatron import plan_megatron
    from jax_ucp.errors import RequestError
    from jax_ucp.models import LMConfig

    want = json.loads((FIX / "fixtures.json").read_text())["legacy_llama_tp2_synthetic"]
    padded, vocab = want["padded_vocab_size"], want["vocab_size"]
    src = FIX / "legacy_llama_tp2_synthetic"
    settings = plan_megatron(LocalDirectory(str(src)), MegatronOptions()).source["settings"]
    assert settings["padded_vocab_size"] == padded and "vocab_size" not in settings
    with pytest.raises(
        RequestError, match=rf"no vocab_size .*padded_vocab_size={padded} .*vocab_size= to strip"
    ):
        LMConfig.from_settings(settings)
    assert LMConfig.from_settings(settings, vocab_size=padded).vocab_size == padded
    settings = plan_megatron(LocalDirectory(str(src)), MegatronOptions(vocab_size=vocab)).source[
        "settings"
    ]
    cfg = LMConfig.from_settings(settings)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (
        vocab, want["hidden_size"], want["num_layers"],
    )  # fmt: skip
    bare = plan_megatron(
        LocalDirectory(str(FIX / "gpt_tp2")), MegatronOptions(vocab_size=vocab)
    ).source["settings"]
    assert bare == {"vocab_size": vocab, "padded_vocab_size": padded}
    with pytest.raises(RequestError, match="no hidden_size, num_layers, num_attention_heads"):
        LMConfig.from_settings(bare)


def test_vocab_size_from_spec_settings_and_step_and_progress(tmp_path):
    from jax_ucp.language import Spec

    seen = []
    d = convert(
        FIX / "gpt_pp2",
        tmp_path / "mgr",
        format="megatron",
        importing=ImportOptions(spec=Spec(settings={"vocab_size": VOCAB})),
        step=7,
        progress=lambda n, i, t: seen.append((n, i, t)),
    )
    assert d.endswith(os.path.join("7", "state"))
    r = jax_ucp.restore(d)
    assert r["params"]["embedding.word_embeddings.weight"].shape[0] == VOCAB
    assert "output_layer.weight" not in r["params"]  # tied: torch_dist stores the embedding only
    assert [i for _, i, _ in seen] == list(range(1, len(seen) + 1)) and seen[-1][2] == len(seen)


# ------------------------------------------------------------------ legacy


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_import_bit_exact(name, converted):
    """TP/PP fragments merged with the language kinds equal megatron-core's own global layout."""
    r = jax_ucp.restore(converted(name))
    ref = load_reference(name)
    used = set()
    for k, v in r["params"].items():
        rk, want = reference_value(k, ref)
        assert_bit_equal(v, want[:VOCAB] if is_vocab(k) else want, k)
        used.add(rk)
    assert used == set(ref), f"reference tensors never produced: {sorted(set(ref) - used)}"


def test_legacy_distributed_optimizer_bit_exact(converted):
    """distrib_optim.pt flat buffers -> params / mu / nu equal every DP rank's gathered shards.

    Stage 0 of this fixture has two grad buckets (the shared embedding gets its own), the case
    where megatron-core's own fully_reshardable conversion mis-slices (its issue #504)."""
    name = "legacy_gpt_distopt_pp2dp2_synthetic"
    r = jax_ucp.restore(converted(name))
    truth = load_optimizer_truth(name)
    trees = {
        "param": r["params"],
        "exp_avg": r["opt_state"]["mu"],
        "exp_avg_sq": r["opt_state"]["nu"],
    }
    for kind, tree in trees.items():
        assert sorted(tree) == sorted(
            n for k, n in truth if k == kind and not n.startswith("tied_copy/")
        )
        for n, v in tree.items():
            want = truth[(kind, n)]
            if is_vocab(n):
                want = want[:VOCAB]
                assert_bit_equal(
                    truth[(kind, "tied_copy/output_layer.weight")][:VOCAB], want, "tied copy"
                )
            assert_bit_equal(v, want, f"{kind}/{n}")
    assert int(r["opt_state"]["count"]) == 2 and "model_params" not in r
    ref = load_reference(name)  # fp32 run: the master weights are the model weights
    for n, v in r["params"].items():
        rk, i = reference_name(n)
        want = ref[rk] if i is None else ref[rk][i]
        assert_bit_equal(v, want[:VOCAB] if is_vocab(n) else want, n)


def test_legacy_missing_distrib_optim(tmp_path):
    src = copy_megatron_fixture("legacy_gpt_distopt_pp2dp2_synthetic", tmp_path)
    (src / "iter_0000002" / "mp_rank_00_001" / "distrib_optim.pt").unlink()
    with pytest.raises(
        MegatronImportError, match=r"missing shard file .*mp_rank_00_001/distrib_optim\.pt"
    ):
        convert(
            src, tmp_path / "out", format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    assert_untouched(tmp_path / "out")


def test_legacy_distrib_optim_wrong_bucket_layout(tmp_path, monkeypatch):
    from jax_ucp._src.importers.megatron import rank_states as lg

    real = lg.distrib_optim_layout
    # one bucket per parameter: no 64-element start padding inside buckets -> totals disagree
    monkeypatch.setattr(
        lg, "distrib_optim_layout", lambda p, shared, bs, *rest: real(p, shared, 1, *rest)
    )
    with pytest.raises(
        MegatronImportError,
        match=r"distrib_optim\.pt:.*\d+ elements.*lay out to",
    ):
        convert(
            FIX / "legacy_gpt_distopt_pp2dp2_synthetic",
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )
    assert_untouched(tmp_path / "out")


def test_legacy_pipeline_tied_and_layer_numbers(converted):
    d = converted("legacy_gpt_tp2pp2_synthetic")
    r = jax_ucp.restore(d)
    names = set(r["params"])
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names  # stage 1's local layer 0
    assert (
        "output_layer.weight" not in names
    )  # last stage's tied copy checked equal, not duplicated
    src = jax_ucp.inspect(d).source
    assert (
        src["tp"] == 2
        and src["pp"] == 2
        and src["tied_embeddings"] == ["embedding.word_embeddings.weight"]
    )
    assert src["settings"]["num_layers"] == 2  # from the pickled argparse.Namespace


def test_legacy_rng_state_and_args_are_inert():
    from jax_ucp._src.importers.megatron import legacy as lg
    from jax_ucp._src.torchfiles.allow_list import StandIn

    ck = lg.open_legacy(LocalDirectory(str(FIX / "legacy_llama_tp2_synthetic")))
    st = ck.ranks[(0, 0)].state
    assert type(st["args"]).__name__ == "Namespace" and ck.args["swiglu"] is True
    np_state = st["rng_state"][0]["np_rng_state"]
    # an inert stand-in, never rebuilt by numpy's own code
    assert isinstance(np_state[1], StandIn) and not isinstance(np_state[1], np.ndarray)


# ------------------------------------------------------------------ into JAX


def _spec_for(name: str):
    from jax_ucp.language import load_spec

    f = fixture_info()[name]
    spec = (
        "megatron_lm_gpt"
        if "lm_names" in name
        else "mixtral"
        if f["kind"] == "moe"
        else "llama"
        if f["kind"] == "llama"
        else "megatron_gpt"
    )
    settings = dict(
        num_attention_heads=f["num_attention_heads"],
        hidden_size=f["hidden_size"],
        num_layers=f["num_layers"],
        vocab_size=VOCAB,
    )
    if f.get("num_experts"):
        settings["num_experts"] = f["num_experts"]
    if f["num_query_groups"]:
        settings["num_query_groups"] = f["num_query_groups"]
    if spec == "megatron_lm_gpt":
        settings["swiglu"] = f["gated"]
    return load_spec(spec, **settings)


@pytest.mark.parametrize("name", TORCH_DIST + LEGACY)
def test_shipped_spec_restore_gives_reference_logits(name, converted):
    """importer -> restore(spec=<shipped spec>) -> flax TransformerLM: the whole chain, with the
    UCP language's lazy views doing the unstack/transpose; equals the numpy mapping bit for bit."""
    from jax_ucp.models import TransformerLM, from_megatron

    d = converted(name)
    cfg = lm_config(name)
    restored = jax_ucp.restore(d, spec=_spec_for(name))
    mine = from_megatron(jax_ucp.restore(d)["params"], cfg)["params"]
    got = restored["params"]
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(mine)
    for (p, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(mine)
    ):
        assert_bit_equal(np.asarray(a), np.asarray(b), jax.tree_util.keystr(p))
    if "model_params" in restored:
        got = restored["model_params"]
    ref = np.load(FIX / f"{reference_of(name)}.logits.npz")
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), {"params": got})
    with jax.default_matmul_precision("highest"):
        out = np.asarray(TransformerLM(cfg).apply(params, ref["tokens"]))
    assert np.abs(out - ref["logits"][..., :VOCAB]).max() <= 1e-5
    if "opt_state" in restored:  # optax adam layout: opt_state/0/{mu,nu,count}
        st = (
            restored["opt_state"]["0"] if "0" in restored["opt_state"] else restored["opt_state"][0]
        )
        assert int(st["count"]) == 2
        assert jax.tree_util.tree_structure(st["mu"]) == jax.tree_util.tree_structure(mine)


def test_convert_detects_megatron_and_cli(tmp_path):
    """jax_ucp.convert and `jax-ucp convert megatron` reach this importer (torch_dist, legacy
    iteration directory)."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    d = jax_ucp.convert(
        FIX / "llama_pp2", tmp_path / "a", importing=MegatronOptions(vocab_size=VOCAB)
    )
    assert jax_ucp.inspect(d).source["framework"] == "megatron"
    it_dir = FIX / "legacy_llama_tp2_synthetic" / "iter_0000007"
    d = jax_ucp.convert(it_dir, tmp_path / "b", importing=MegatronOptions(vocab_size=VOCAB))
    assert jax_ucp.inspect(d).source["iteration"] == 7
    res = CliRunner().invoke(
        app,
        [
            "convert",
            str(FIX / "gpt_tp2"),
            str(tmp_path / "c"),
            "--from",
            "megatron",
            "--vocab-size",
            str(VOCAB),
        ],
    )
    assert res.exit_code == 0, res.output
    assert jax_ucp.restore(tmp_path / "c")["params"]["output_layer.weight"].shape == (VOCAB, 32)
    empty = tmp_path / "empty"
    empty.mkdir()
    res = CliRunner().invoke(
        app, ["convert", str(empty), str(tmp_path / "d"), "--from", "megatron"]
    )
    assert res.exit_code != 0 and "not a Megatron" in " ".join(res.output.split())
    assert not (tmp_path / "d").exists()


def test_legacy_with_shipped_spec_import_rules(tmp_path):
    """The shipped megatron_gpt spec's (strict) import rules merge the legacy TP x PP fragments the
    same way as the built-in rules; head counts come from the pickled args."""
    d = convert(
        FIX / "legacy_gpt_tp2pp2_synthetic",
        tmp_path / "o",
        format="megatron",
        importing=MegatronOptions(spec="megatron_gpt", vocab_size=VOCAB),
    )
    r = jax_ucp.restore(d)
    ref = load_reference("legacy_gpt_tp2pp2_synthetic")
    for k, v in r["params"].items():
        rk, i = reference_name(k)
        want = ref[rk] if i is None else ref[rk][i]
        assert_bit_equal(v, want[:VOCAB] if is_vocab(k) else want, k)


def test_cli_spec_file_supplies_settings(tmp_path):
    """`--spec FILE`: a user-written TOML spec whose settings give the vocab size."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    f = tmp_path / "my.toml"
    f.write_text(f'name = "mine"\n[settings]\nvocab_size = {VOCAB}\n')
    res = CliRunner().invoke(
        app,
        [
            "convert",
            str(FIX / "legacy_llama_tp2_synthetic"),
            str(tmp_path / "o"),
            "--from",
            "megatron",
            "--spec",
            str(f),
        ],
    )
    assert res.exit_code == 0, res.output
    r = jax_ucp.restore(tmp_path / "o")["params"]
    assert r["embedding.word_embeddings.weight"].shape == (VOCAB, 32)
    assert r["decoder.layers.1.mlp.linear_fc1.weight"].shape == (
        96,
        32,
    )  # [gate; up] merged over TP


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("name", ["gpt_tp2", "legacy_gpt_tp2pp2_synthetic"])
def test_vocab_size_larger_than_padded(name, tmp_path):
    with pytest.raises(
        MegatronImportError, match=r"word_embeddings\.weight.*(fewer than|64 rows).*vocab_size=100"
    ):
        convert(
            FIX / name,
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=100),
        )
    assert_untouched(tmp_path / "out")


def test_missing_shard_file(tmp_path):
    src = copy_megatron_fixture("gpt_tp2", tmp_path)
    (src / "__1_0.distcp").unlink()
    dest = tmp_path / "out"
    with pytest.raises(MegatronImportError, match=r"tensor '.+'.*__1_0\.distcp is missing"):
        convert(src, dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB))
    assert_untouched(dest)


def test_metadata_references_absent_file(tmp_path):
    src = copy_megatron_fixture("llama_tp2", tmp_path)
    md = (src / ".metadata").read_bytes()
    assert b"__1_1.distcp" in md
    (src / ".metadata").write_bytes(md.replace(b"__1_1.distcp", b"__7_7.distcp"))
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError, match=r"tensor '.+'.*__7_7\.distcp is missing.*\.metadata"
    ):
        convert(src, dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB))
    assert_untouched(dest)


def test_truncated_shard_file(tmp_path):
    src = copy_megatron_fixture("gpt_tp2", tmp_path)
    f = src / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    dest = tmp_path / "out"
    with pytest.raises(MegatronImportError, match=r"__0_0\.distcp has 1000 bytes.*truncated"):
        convert(src, dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB))
    assert_untouched(dest)


def _patched_open(monkeypatch, edit):
    real = dcp.open_dcp

    def fake(path):
        ck = real(path)
        edit(ck)
        return ck

    monkeypatch.setattr(dcp, "open_dcp", fake)


def test_incomplete_shard_coverage(tmp_path, monkeypatch):
    name = "decoder.layers.self_attention.linear_qkv.weight"

    def drop(ck):
        t = ck.tensors[name]
        ck.tensors[name] = dcp.DcpTensor(t.name, t.shape, t.dtype, t.chunks[:-1])

    _patched_open(monkeypatch, drop)
    dest = tmp_path / "out"
    with pytest.raises(MegatronImportError, match=rf"tensor '{name}'.*incomplete shard coverage"):
        convert(
            FIX / "gpt_tp2", dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    assert_untouched(dest)


def test_overlapping_shards(tmp_path, monkeypatch):
    name = "embedding.word_embeddings.weight"

    def overlap(ck):
        t = ck.tensors[name]
        c0, c1 = t.chunks
        c1 = dcp.DcpChunk((16, 0), c1.sizes, c1.file, c1.byte_offset, c1.byte_length)
        ck.tensors[name] = dcp.DcpTensor(t.name, t.shape, t.dtype, (c0, c1))

    _patched_open(monkeypatch, overlap)
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError, match=rf"tensor '{name}': overlapping shards.*__0_0.distcp"
    ):
        convert(
            FIX / "gpt_tp2", dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    assert_untouched(dest)


def test_chunk_shape_disagreement(tmp_path, monkeypatch):
    """A storage entry pointing at another tensor's bytes (same dtype, other shape)."""
    name, other = "decoder.final_layernorm.weight", "embedding.position_embeddings.weight"

    def swap(ck):
        t, o = ck.tensors[name], ck.tensors[other].chunks[0]
        c = t.chunks[0]
        ck.tensors[name] = dcp.DcpTensor(
            t.name,
            t.shape,
            t.dtype,
            (dcp.DcpChunk(c.offsets, c.sizes, o.file, o.byte_offset, o.byte_length),),
        )

    _patched_open(monkeypatch, swap)
    with pytest.raises(
        MegatronImportError,
        match=rf"tensor '{name}' chunk at offsets \[0\] in .*distcp: shape disagreement: "
        r"metadata says \[32\], bytes hold \[32, 32\]",
    ):
        convert(
            FIX / "gpt_tp2",
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )
    assert_untouched(tmp_path / "out")


def with_fixed_crcs(raw: bytes) -> bytes:
    """``raw`` (zip archives, possibly several back to back) with every stored member's CRC-32
    recomputed in its central directory entry: an edit that keeps the archive self-consistent,
    so that the checks after the CRC's are what is tested. (torch writes sizes and CRCs in the
    central directory and a data descriptor; its local headers hold zeros.)"""
    out = bytearray(raw)
    i = 0
    while (i := out.find(b"PK\x03\x04", i)) >= 0:
        n, extra = struct.unpack_from("<HH", out, i + 26)
        name, start = bytes(out[i + 30 : i + 30 + n]), i + 30 + n + extra
        c = i
        while (c := out.find(b"PK\x01\x02", c + 1)) >= 0:
            if bytes(out[c + 46 : c + 46 + struct.unpack_from("<H", out, c + 28)[0]]) == name:
                size = struct.unpack_from("<I", out, c + 20)[0]
                struct.pack_into("<I", out, c + 16, zlib.crc32(out[start : start + size]))
                break
        i = start
    return bytes(out)


def test_dtype_disagreement_on_disk(tmp_path):
    """A chunk whose embedded archive says int16 while .metadata says float32."""
    src = copy_megatron_fixture("gpt_tp2", tmp_path)
    f = src / "__1_0.distcp"
    b = f.read_bytes()
    assert b"FloatStorage" in b
    f.write_bytes(with_fixed_crcs(b.replace(b"FloatStorage", b"ShortStorage", 1)))
    dest = tmp_path / "out"
    with pytest.raises(
        MegatronImportError,
        # the storage's bytes are those of float32 values: twice what int16 storage needs
        match=r"'.+' chunk .*/__1_0\.distcp:.*expected \d+ bytes \(\d+ x int16\), member holds",
    ):
        convert(src, dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB))
    assert_untouched(dest)


def test_failed_import_leaves_existing_destination(tmp_path):
    src = copy_megatron_fixture("gpt_tp2", tmp_path)
    (src / "__0_1.distcp").unlink()
    dest = tmp_path / "out"
    convert(FIX / "gpt_tp2", dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB))
    before = (dest / "ucp.json").read_bytes()
    with pytest.raises(MegatronImportError):
        convert(
            src, dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB), force=True
        )
    assert (dest / "ucp.json").read_bytes() == before  # the earlier import, whole
    assert jax_ucp.verify(dest) == []
    with pytest.raises(FileExistsError):
        convert(
            FIX / "gpt_tp2", dest, format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    user = tmp_path / "user"  # a folder that is not a checkpoint: refused untouched, even forced
    user.mkdir()
    (user / "keep.txt").write_text("x")
    with pytest.raises(jax_ucp.SaveConflictError, match=r"keep.txt"):
        convert(
            FIX / "gpt_tp2",
            user,
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
            force=True,
        )
    assert (user / "keep.txt").read_text() == "x"


def test_unknown_transform_descriptor_rejected_by_name(tmp_path, monkeypatch):
    name = "decoder.final_layernorm.weight"

    def add(ck):
        t = ck.tensors[name]
        c = t.chunks[0]
        ck.tensors[name] = dcp.DcpTensor(
            t.name,
            t.shape,
            t.dtype,
            (
                dcp.DcpChunk(
                    c.offsets, c.sizes, c.file, c.byte_offset, c.byte_length, ("stream.lz4/1",)
                ),
            ),
        )

    _patched_open(monkeypatch, add)
    with pytest.raises(
        MegatronImportError,
        match=rf"tensor '{name}'.*unsupported transform descriptor 'stream.lz4/1'",
    ):
        convert(
            FIX / "gpt_tp2",
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )
    assert_untouched(tmp_path / "out")


def test_metadata_pickle_with_code_is_refused(tmp_path):
    src = copy_megatron_fixture("gpt_tp2", tmp_path)
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(
        MegatronImportError, match=r"\.metadata.*refusing to load global 'os.system'"
    ):
        convert(
            src, tmp_path / "out", format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    assert not marker.exists()
    assert_untouched(tmp_path / "out")


def test_unsupported_optimizer_layout_named(tmp_path, monkeypatch):
    def rename(ck):
        t = ck.tensors.pop("optimizer.state.exp_avg.output_layer.weight")
        ck.tensors["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.exp_avg"] = t

    _patched_open(monkeypatch, rename)
    with pytest.raises(
        MegatronImportError,
        match=r"optimizer\.distributed\.dp_group_idx_0.*supported .*'fully_reshardable'.*"
        r"weights_only",
    ):
        convert(
            FIX / "gpt_distopt_dp2",
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )


def test_legacy_missing_rank(tmp_path):
    src = copy_megatron_fixture("legacy_gpt_tp2pp2_synthetic", tmp_path)
    shutil.rmtree(src / "iter_0000007" / "mp_rank_01_001")
    with pytest.raises(MegatronImportError, match=r"missing rank directory .*mp_rank_01_001"):
        convert(
            src, tmp_path / "out", format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    assert_untouched(tmp_path / "out")


def test_legacy_missing_file_and_bad_tracker(tmp_path):
    src = copy_megatron_fixture("legacy_llama_tp2_synthetic", tmp_path)
    (src / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    with pytest.raises(
        MegatronImportError, match=r"missing shard file .*mp_rank_01/model_optim_rng\.pt"
    ):
        convert(
            src, tmp_path / "out", format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )
    (src / "latest_checkpointed_iteration.txt").write_text("9")
    # a tracker file that names no iteration is this checkpoint gone wrong, said as such
    with pytest.raises(MegatronImportError, match=r"names iteration 9 but .*iter_0000009 does not"):
        convert(
            src, tmp_path / "out", format="megatron", importing=MegatronOptions(vocab_size=VOCAB)
        )


def test_legacy_old_qkv_ordering_refused(tmp_path, monkeypatch):
    from jax_ucp._src.importers.megatron import legacy as lg

    real = lg.open_legacy

    def old(path):
        ck = real(path)
        ck.checkpoint_version = 1.0
        return ck

    monkeypatch.setattr(lg, "open_legacy", old)
    with pytest.raises(
        MegatronImportError, match=r"mp_rank_00/model_optim_rng\.pt: checkpoint_version 1\.0 .*QKV"
    ):
        convert(
            FIX / "legacy_llama_tp2_synthetic",
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )


def test_legacy_tp_ranks_disagree_on_replicated_tensor(tmp_path, monkeypatch):
    from jax_ucp._src.importers.megatron import legacy as lg

    real = lg.open_legacy

    def corrupt(path):
        ck = real(path)
        m = ck.ranks[(0, 1)].model
        k = "decoder.final_layernorm.weight"
        m[k] = m[k] + np.float32(1.0)
        return ck

    monkeypatch.setattr(lg, "open_legacy", corrupt)
    with pytest.raises(
        MegatronImportError, match=r"decoder\.final_layernorm\.weight.*disagree.*mp_rank_01"
    ):
        convert(
            FIX / "legacy_llama_tp2_synthetic",
            tmp_path / "out",
            format="megatron",
            importing=MegatronOptions(vocab_size=VOCAB),
        )
    assert_untouched(tmp_path / "out")
