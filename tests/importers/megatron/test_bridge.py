"""Megatron Bridge checkpoints (megatron-bridge 0.6.2 over megatron-core 0.19.2, written on CPU
by Bridge's own ``save_checkpoint``: tools/fixtures/make_megatron_bridge_fixture.py): detected,
imported bit-exact against the run's live state (``<name>.truth.npz``), the model settings read
from ``run_config.yaml``, the step from ``train_state.pt``; hostile or broken files refused with
the file named and nothing written."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.importers.megatron import MegatronOptions, plan_megatron
from jax_ucp._src.importers.megatron import bridge as megatron_bridge
from jax_ucp._src.importers.megatron.common import MegatronImportError
from jax_ucp._src.store.storage import LocalDirectory
from jax_ucp.cli import app
from jax_ucp.conversion import ImportOptions
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.join(REPO, "tests", "fixtures", "megatron_bridge")
FULL = os.path.join(ROOT, "llama_tp1dp2")  # TP1 DP2 fp32, optimizer + RNG state
WEIGHTS = os.path.join(ROOT, "llama_bf16_tp2_weights")  # TP2 bf16, save_optim=False
# the same seeded run as FULL saved fully_reshardable (model-space optimizer state); its live
# state was bit-identical to FULL's (compared by the generator), so FULL's truth serves
RESHARDABLE = os.path.join(ROOT, "llama_tp1dp2_fully_reshardable")
VOCAB = 61  # run_config.yaml's model.vocab_size (Bridge pads it to 64)
ITER = "iter_0000002"


def _stripped(name: str, value: np.ndarray) -> np.ndarray:
    vocab = name.endswith(("word_embeddings.weight", "output_layer.weight"))
    return value[:VOCAB] if vocab else value


def _truth(src: str) -> dict[str, np.ndarray]:
    """The run's live state; bfloat16 arrays are stored as their uint16 bits (npz has none)."""
    z = np.load(src + ".truth.npz")
    bf16 = set(z["__bfloat16_keys__"].tolist())
    return {
        k: z[k].view(ml_dtypes.bfloat16) if k in bf16 else z[k]
        for k in z.files
        if k != "__bfloat16_keys__"
    }


def test_fixtures_are_small_and_what_bridge_writes():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ROOT) for f in fs)
    # 0.56 MB for the pretraining and weights-only saves, + 0.32 MB for fully_reshardable
    assert total <= 900_000, f"megatron_bridge fixtures take {total} bytes"
    info = json.load(open(os.path.join(ROOT, "fixtures.json")))
    assert info["megatron_bridge"] == "0.6.2" and info["megatron_core"] == "0.19.2"
    for src in (FULL, WEIGHTS, RESHARDABLE):
        assert sorted(os.listdir(src)) == [
            ITER,
            "latest_checkpointed_iteration.txt",
            "latest_train_state.pt",
        ]
        files = sorted(os.listdir(os.path.join(src, ITER)))
        # megatron-core 0.19: no common.pt (the common state is an object of the checkpoint)
        assert files == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "metadata.json",
            "run_config.yaml",
            "train_state.pt",
        ]


@pytest.mark.parametrize("where", ["root", "iter_dir"])
def test_pretraining_save_imports_bit_exact(tmp_path, where):
    """fp32 TP1 DP2, Bridge's defaults (dp_reshardable, fully parallel save): fp32 masters and
    both Adam moments equal the run's live state bit for bit; the step is the train state's;
    the vocab padding is stripped with run_config.yaml's vocab size (no vocab_size= given)."""
    src = FULL if where == "root" else os.path.join(FULL, ITER)
    assert registry.detect_format(src) == "megatron"
    ckpt = jax_ucp.convert(src, str(tmp_path / "ucp"))
    got = jax_ucp.restore(ckpt)
    truth = _truth(FULL)
    states = {k for k in truth if k.startswith("optimizer.state.")}
    assert states and not {k for k in truth if k.startswith("model.")}  # fp32: masters = weights
    trees = {"param": got["params"], "exp_avg": got["opt_state"]["mu"]}
    trees["exp_avg_sq"] = got["opt_state"]["nu"]
    for key in states:
        state, _, name = key[len("optimizer.state.") :].partition(".")
        want = _stripped(name, truth[key])
        assert trees[state][name].dtype == want.dtype and trees[state][name].shape == want.shape
        assert trees[state][name].tobytes() == want.tobytes(), key
    assert len(got["params"]) == len(states) // 3 == 9
    assert int(got["opt_state"]["count"]) == int(truth["step"]) == 2
    assert "model_params" not in got
    source = jax_ucp.inspect(ckpt).source
    assert source["framework"] == "megatron-bridge"
    assert source["iteration"] == 2 and source["optimizer_layout"] == "dp_reshardable"
    assert source["bridge"]["train_state"]["step"] == 2
    assert source["bridge"]["train_state"]["consumed_train_samples"] == 8
    assert source["bridge"]["model_provider"].endswith("GPTModelProvider")
    settings = source["settings"]
    assert {k: settings[k] for k in ("num_attention_heads", "num_query_groups", "head_dim")} == {
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "head_dim": 4,
    }
    assert settings["swiglu"] is True and settings["untie_embeddings_and_output_weights"] is True
    assert settings["vocab_size"] == VOCAB and settings["padded_vocab_size"] == 64
    assert source["vocab_stripped"]["embedding.word_embeddings.weight"] == [64, VOCAB]
    assert not any("vocab padding kept" in n for n in source.get("notes", []))


def test_fully_reshardable_save_imports_bit_exact(tmp_path):
    """fp32 TP1 DP2 with ``dist_ckpt_optim_fully_reshardable=True``: model-space optimizer
    tensors (``optimizer.state.{param,exp_avg,exp_avg_sq}.*``), the step from the common state's
    param_groups; masters and moments equal the run's live state bit for bit."""
    from jax_ucp._src.importers.megatron import dcp as megatron_dcp

    original = megatron_dcp.open_dcp(LocalDirectory(os.path.join(RESHARDABLE, ITER)))
    optimizer = sorted(n for n in original.tensors if n.startswith("optimizer."))
    assert len(optimizer) == 27 and optimizer[0].startswith("optimizer.state.")  # model space
    ckpt = jax_ucp.convert(RESHARDABLE, str(tmp_path / "ucp"))
    source = jax_ucp.inspect(ckpt).source
    assert (
        source["framework"] == "megatron-bridge" and source["optimizer_layout"] == "per_parameter"
    )
    model = [n for n in original.tensors if not n.startswith("optimizer.")]
    assert sorted(source["skipped"]) == sorted(model)  # fp32: the masters are params/
    got = jax_ucp.restore(ckpt)
    truth = _truth(FULL)
    trees = {"param": got["params"], "exp_avg": got["opt_state"]["mu"]}
    trees["exp_avg_sq"] = got["opt_state"]["nu"]
    states = [k for k in truth if k.startswith("optimizer.state.")]
    assert len(states) == 27 and len(got["params"]) == 9
    for key in states:
        state, _, name = key[len("optimizer.state.") :].partition(".")
        want = _stripped(name, truth[key])
        assert trees[state][name].dtype == want.dtype and trees[state][name].shape == want.shape
        assert trees[state][name].tobytes() == want.tobytes(), key
    assert int(got["opt_state"]["count"]) == int(truth["step"]) == 2


def test_weights_only_save_imports_bit_exact(tmp_path):
    """bf16 TP2 saved with save_optim=False: the bf16 weights are the params, bit for bit the
    run's live weights (TP halves merged by the torch_dist metadata); no optimizer state."""
    ckpt = jax_ucp.convert(WEIGHTS, str(tmp_path / "ucp"))
    got = jax_ucp.restore(ckpt)
    truth = _truth(WEIGHTS)
    model = {k[len("model.") :]: v for k, v in truth.items() if k.startswith("model.")}
    assert len(model) == 9 and not {k for k in truth if k.startswith("optimizer.")}
    assert set(got["params"]) == set(model)
    for name, value in model.items():
        want = _stripped(name, value)
        assert str(got["params"][name].dtype) == "bfloat16" == str(want.dtype), name
        assert got["params"][name].shape == want.shape, name
        assert got["params"][name].tobytes() == want.tobytes(), name
    assert "opt_state" not in got
    source = jax_ucp.inspect(ckpt).source
    assert source["iteration"] == int(truth["step"]) == 2
    assert source["bridge"]["save_optim"] is False and source["settings"]["tp"] == 2


def test_weights_only_import_names_every_optimizer_tensor(tmp_path):
    ckpt = jax_ucp.convert(FULL, str(tmp_path / "ucp"), importing=ImportOptions(weights_only=True))
    source = jax_ucp.inspect(ckpt).source
    skipped = source["skipped"]
    buffers = [n for n in skipped if n.startswith("optimizer.distributed.")]
    assert len(buffers) == 3  # param, exp_avg, exp_avg_sq of the one bucket
    assert all("weights_only" in skipped[n] for n in buffers)
    got = jax_ucp.restore(ckpt)
    assert "opt_state" not in got and len(got["params"]) == 9


def test_cli_convert_megatron_reads_a_bridge_save(tmp_path):
    out = tmp_path / "ucp"
    result = CliRunner().invoke(app, ["convert", FULL, str(out), "--from", "megatron"])
    assert result.exit_code == 0, result.output
    assert jax_ucp.inspect(str(out)).source["framework"] == "megatron-bridge"


def test_a_spec_setting_overrides_the_run_config(tmp_path):
    from jax_ucp.language import Spec

    spec = Spec(name="mine", settings={"vocab_size": 62})
    plan = megatron_bridge.plan_megatron_bridge(
        LocalDirectory(str(FULL)), MegatronOptions(spec=spec), plan_megatron
    )
    assert plan.source["settings"]["vocab_size"] == 62
    assert plan.source["settings"]["num_query_groups"] == 2  # the rest from run_config.yaml
    assert plan.source["vocab_stripped"]["output_layer.weight"] == [64, 62]


# ------------------------------------------------------------------------- broken and hostile


@pytest.fixture
def bridge_copy(tmp_path):
    dst = tmp_path / "bridge"
    shutil.copytree(FULL, dst)
    return dst


def _refused(src, tmp_path, match: str) -> None:
    out = tmp_path / "ucp"
    with pytest.raises(MegatronImportError, match=match):
        jax_ucp.convert(str(src), str(out))
    assert not out.exists()


def test_missing_run_config_is_refused(bridge_copy, tmp_path):
    os.remove(bridge_copy / ITER / "run_config.yaml")
    _refused(
        bridge_copy,
        tmp_path,
        rf"{ITER}/run_config\.yaml: missing; Megatron Bridge writes run_config\.yaml beside "
        r"train_state\.pt at every save, and only it records the model settings",
    )


def test_billion_laughs_run_config_is_refused_in_bounded_time(bridge_copy, tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    lines += ["model: {num_layers: 2, hidden_size: 16, extra: *a9}"]
    (bridge_copy / ITER / "run_config.yaml").write_text("\n".join(lines) + "\n")
    _refused(
        bridge_copy,
        tmp_path,
        r"run_config\.yaml: more than 1000000 YAML nodes once its aliases are expanded "
        r"\(an alias bomb\?\)",
    )


def test_self_containing_alias_is_refused(bridge_copy, tmp_path):
    (bridge_copy / ITER / "run_config.yaml").write_text("model: &m {num_layers: 2, again: *m}\n")
    _refused(bridge_copy, tmp_path, r"run_config\.yaml: a YAML alias that contains itself")


def test_python_tags_build_nothing(bridge_copy, tmp_path):
    (bridge_copy / ITER / "run_config.yaml").write_text(
        "model: !!python/object/apply:os.system ['touch pwned']\n"
    )
    _refused(bridge_copy, tmp_path, r"run_config\.yaml: not valid YAML \(could not determine a")
    assert not os.path.exists("pwned")


def test_oversized_run_config_is_refused(bridge_copy, tmp_path, monkeypatch):
    monkeypatch.setattr(megatron_bridge, "MAX_RUN_CONFIG_BYTES", 1000)
    size = os.path.getsize(bridge_copy / ITER / "run_config.yaml")
    _refused(bridge_copy, tmp_path, rf"run_config\.yaml: {size} bytes, more than the 1000")


def test_bad_model_setting_is_named(bridge_copy, tmp_path):
    path = bridge_copy / ITER / "run_config.yaml"
    text = path.read_text().replace("  num_query_groups: 2\n", "  num_query_groups: two\n")
    path.write_text(text)
    _refused(
        bridge_copy,
        tmp_path,
        r"run_config\.yaml: model\.num_query_groups is 'two', expected a non-negative integer",
    )


def test_a_run_config_cut_before_the_vocab_size_is_refused(bridge_copy, tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind megatron_bridge
    --seed 7 --index 1``): the file cut to half its bytes is still valid YAML whose model
    section stops before ``vocab_size``; the import kept the padding rows of the embedding and
    the output layer (different values than the whole file gives, no error)."""
    path = bridge_copy / ITER / "run_config.yaml"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _refused(
        bridge_copy,
        tmp_path,
        r"run_config\.yaml: the 'model' section has no 'vocab_size' \(Bridge writes every field "
        r"of the model provider; found \d+ fields\): the run config is truncated or not Bridge's",
    )


def test_train_state_of_another_iteration_is_refused(bridge_copy, tmp_path):
    os.rename(bridge_copy / ITER, bridge_copy / "iter_0000003")
    _refused(
        bridge_copy,
        tmp_path,
        r"latest_train_state\.pt: step 2, but .*iter_0000002 \(its iteration directory\) is "
        r"missing; iteration directories here: iter_0000003",
    )
    _refused(
        bridge_copy / "iter_0000003",
        tmp_path,
        r"iter_0000003/train_state\.pt: step 2, but the directory is iter_0000003",
    )


def test_disagreeing_trackers_are_refused(bridge_copy, tmp_path):
    (bridge_copy / "latest_checkpointed_iteration.txt").write_text("7")
    _refused(
        bridge_copy,
        tmp_path,
        r"latest_checkpointed_iteration\.txt: iteration 7, but .*latest_train_state\.pt says "
        r"step 2",
    )


def test_train_state_that_is_not_one_is_refused(bridge_copy, tmp_path):
    (bridge_copy / ITER / "train_state.pt").write_bytes(b"not a zip file")
    os.remove(bridge_copy / "latest_train_state.pt")
    _refused(bridge_copy / ITER, tmp_path, rf"{ITER}/train_state\.pt")


def test_run_config_settings_alone_restore_into_flax(tmp_path):
    """The settings read from run_config.yaml are all a flax model and the shipped llama spec
    need: nothing completed by hand. Spec route (lazy views) == numpy mapping, bit for bit."""
    import jax

    from jax_ucp.language import load_spec
    from jax_ucp.models import LMConfig, TransformerLM, from_megatron

    ckpt = jax_ucp.convert(FULL, str(tmp_path / "ucp"))
    settings = jax_ucp.inspect(ckpt).source["settings"]
    cfg = LMConfig.from_settings(settings)
    assert (cfg.num_query_groups, cfg.gated, cfg.position, cfg.tied) == (2, True, "rope", False)
    mine = from_megatron(jax_ucp.restore(ckpt)["params"], cfg)["params"]
    keys = ("num_attention_heads", "num_query_groups", "hidden_size", "num_layers", "vocab_size")
    spec = load_spec("llama", **{k: settings[k] for k in keys})
    got = jax_ucp.restore(ckpt, spec=spec)["params"]
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(mine)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(mine)
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)
    logits = TransformerLM(cfg).apply({"params": got}, np.arange(8, dtype=np.int32)[None])
    assert logits.shape == (1, 8, VOCAB) and np.isfinite(np.asarray(logits)).all()


def test_save_directory_without_latest_train_state_is_found_by_the_tracker(bridge_copy, tmp_path):
    """Megatron-LM's tracker (which Bridge writes too) leads to the iteration directory; it is
    still read as Bridge's (run_config.yaml's settings: the vocab padding stripped)."""
    os.remove(bridge_copy / "latest_train_state.pt")
    assert megatron_bridge.is_megatron_bridge(LocalDirectory(str(bridge_copy)))
    source = jax_ucp.inspect(jax_ucp.convert(str(bridge_copy), str(tmp_path / "u"))).source
    assert source["framework"] == "megatron-bridge" and source["iteration"] == 2
    assert source["vocab_stripped"]["output_layer.weight"] == [64, VOCAB]


# Inputs a careless or hostile user hands over, built here torch-free: each imports exactly or is
# refused naming the file, the key and the cause (never an internal "please report").


BRIDGE = os.path.join(REPO, "tests", "fixtures", "megatron_bridge", "llama_tp1dp2")


def _bridge(tmp_path):
    dst = tmp_path / "bridge"
    shutil.copytree(BRIDGE, dst)
    return dst


def _bridge_refused(src, tmp_path, match: str) -> str:

    with pytest.raises(MegatronImportError, match=match) as err:
        jax_ucp.convert(str(src), str(tmp_path / "ucp"))
    assert not (tmp_path / "ucp").exists()
    assert len(str(err.value)) < 1000
    return str(err.value)


def test_bridge_train_state_step_that_only_looks_like_a_tensor_is_named(tmp_path):
    """``step`` pickled as an OrderedDict given a ``shape`` attribute by BUILD: it has the shape
    of a 0-d tensor but is none (was a raw AttributeError on ``.item()``)."""
    import pickle as P

    from tests.torchfiles.test_pickle_format import D, G, prog, write_pt

    src = _bridge(tmp_path)
    step = G("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE
    step += P.EMPTY_DICT + D("shape") + D(()) + P.SETITEM + P.BUILD
    body = P.EMPTY_DICT + D("step") + step + P.SETITEM
    os.remove(src / "latest_train_state.pt")
    os.remove(src / ITER / "train_state.pt")
    write_pt(src / ITER / "train_state.pt", prog(body))
    _bridge_refused(
        src / ITER,
        tmp_path,
        ITER + r"/train_state\.pt: entry 'step' is \{\}, expected a 0-d tensor",
    )


def test_bridge_train_state_step_of_5000_digits_is_named(tmp_path):
    """A pickled int past Python's 4300-digit repr limit: the error is built without repr()."""
    from tests.torchfiles.test_pickle_format import D, prog, write_pt

    src = _bridge(tmp_path)
    os.remove(src / "latest_train_state.pt")
    os.remove(src / ITER / "train_state.pt")
    write_pt(src / ITER / "train_state.pt", prog(b"}" + D("step") + D(10**5000) + b"s"))
    _bridge_refused(
        src / ITER,
        tmp_path,
        ITER + r"/train_state\.pt: entry 'step' is <int of 16610 bits>, expected a 0-d tensor",
    )


def _run_config_with(src, key: str, value: str) -> None:
    path = src / ITER / "run_config.yaml"
    text = path.read_text()
    old = next(line for line in text.splitlines() if line.startswith(f"  {key}: "))
    path.write_text(text.replace(old + "\n", f"  {key}: {value}\n", 1))


@pytest.mark.parametrize(
    "key, value, shown",
    [
        ("hidden_size", "9" * 5000, "9" * 20),  # Python's int-digit limit: was a raw ValueError
        ("vocab_size", "0x" + "f" * 2_000_000, "0x" + "f" * 18),  # was raised formatting ours
    ],
    ids=["5000-digit hidden_size", "2-million-hex-digit vocab_size"],
)
def test_bridge_run_config_number_too_long_is_named(tmp_path, key, value, shown):
    src = _bridge(tmp_path)
    _run_config_with(src, key, value)
    _bridge_refused(
        src,
        tmp_path,
        rf"{ITER}/run_config\.yaml: model\.{key} \(line \d+\) is a number of {len(value)} "
        rf"characters \({shown}\.\.\.\); a run config's numbers have at most 64",
    )


def test_bridge_run_config_integer_beyond_int64_is_named(tmp_path):
    src = _bridge(tmp_path)
    _run_config_with(src, "vocab_size", "0x" + "f" * 40)  # 160 bits, short enough to spell
    _bridge_refused(
        src,
        tmp_path,
        r"run_config\.yaml: model\.vocab_size is an integer of 160 bits, expected a "
        r"non-negative integer below 2\*\*63",
    )


def test_an_iteration_folder_linked_out_is_refused_before_a_read_through_it(tmp_path):
    """``iter_0000002`` moved out of the save directory and linked back: its train_state.pt was
    read through the link (to check its step) before the link was refused, by convert and a
    direct restore (harness ``megatron_bridge`` seed 23 #4). Now refused first, nothing read."""
    from tests.hostile.spy import watch_opens

    src, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(FULL, src)
    outside.mkdir()
    shutil.move(src / ITER, outside / ITER)
    os.symlink(os.path.join("..", "outside", ITER), src / ITER)
    opened = []
    with watch_opens(lambda path, writing: opened.append(os.path.realpath(str(path)))):
        for run in (lambda: jax_ucp.convert(src, tmp_path / "out"), lambda: jax_ucp.restore(src)):
            with pytest.raises(
                jax_ucp.SourceError, match=rf"'{ITER}' resolves to .*outside the checkpoint"
            ):
                run()
    assert not [p for p in opened if p.startswith(str(outside.resolve()))], opened
