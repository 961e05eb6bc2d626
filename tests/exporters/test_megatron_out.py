"""jax_ucp.export to megatron-core torch_dist: a Megatron import exported at another TP reads back
bit-exact (weights, fp32 masters, moments, step), megatron-core itself loads it and continues
it (torch-marked), clear refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.megatron import MegatronOptions, legacy
from jax_ucp._src.torchfiles import torch_zip
from jax_ucp.errors import RequestError
from jax_ucp.exporters import MegatronExport
from jax_ucp.models import TransformerLM, from_megatron
from tests.megatron_testing import (
    FIX,
    VOCAB,
    assert_bit_equal,
    lm_config,
    reference_of,
    reference_value,
)
from tests.ucp_testing import REPO, free_port, save_small_tree

pytestmark = pytest.mark.timeout(120)

RUN = "llama_distopt_bf16_tp2dp2"  # megatron-core's bf16 TP2 x DP2 run, 2 Adam steps
MOE = FIX / "mcore_versions" / "0.16.1"  # megatron-core's MoE runs (EP2, Adam, 2 steps)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """The fixture run imported with its optimizer state (vocab padding stripped)."""
    out = tmp_path_factory.mktemp("megatron_out") / "ucp"
    jax_ucp.convert(FIX / RUN, out, importing=MegatronOptions(vocab_size=VOCAB))
    return out


def _reimported(export: Path) -> Path:
    back = export.with_name(export.name + ".ucp")
    jax_ucp.convert(export, back, importing=MegatronOptions(vocab_size=VOCAB))
    return back


@pytest.mark.parametrize("tp", [1, 2])
def test_export_reads_back_bit_exact(imported, tp):
    """Fixture (TP2) -> import -> export at TP ``tp`` -> import: every leaf bit-identical (the
    bf16 weights, fp32 masters, both moments, the step), the vocab padded for ``tp``, the common
    state what megatron-core and Megatron-LM read."""
    dst = imported.parent / f"tp{tp}"
    done = jax_ucp.export(imported, dst, MegatronExport(tp=tp))
    assert sorted(done.files) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert done.tensors == 4 * 9 and done.skipped == []
    back = _reimported(dst)
    diff = jax_ucp.diff(imported, back)
    assert diff.identical, (diff.tensors, diff.only_in_a, diff.only_in_b)
    assert diff.same == len(jax_ucp.inspect(imported).tensors) == 37
    source = jax_ucp.inspect(back).source or {}
    padded = 128 * tp  # Megatron-LM's default make_vocab_size_divisible_by, times TP
    assert source["vocab_stripped"]["embedding.word_embeddings.weight"] == [padded, VOCAB]
    assert source["optimizer_layout"] == "per_parameter"
    common = torch_zip.load_torch_file(dst / "common.pt", legacy.LEGACY_CLASSES)
    assert common["iteration"] == 2 and common["checkpoint_version"] == 3.0
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["step"], g["betas"]) for g in groups] == [
        (1.0, 2.0, (0.9, 0.95)),
        (0.0, 2.0, (0.9, 0.95)),
    ]
    args = legacy.args_dict(common["args"])
    assert (args["tensor_model_parallel_size"], args["padded_vocab_size"]) == (tp, padded)
    assert (args["num_layers"], args["hidden_size"]) == (2, 32)


def test_export_under_a_budget_is_the_same_export(imported, tmp_path):
    """Read in row slabs of a 4 KiB budget (the padded vocab tensors' rows in several slabs,
    then their zero rows), the export is byte for byte the default one."""
    small = jax_ucp.export(imported, tmp_path / "small", MegatronExport(memory_budget="4KiB"))
    default = jax_ucp.export(imported, tmp_path / "default", MegatronExport())
    for name in default.files:
        assert (tmp_path / "small" / name).read_bytes() == (
            tmp_path / "default" / name
        ).read_bytes()
    assert small.files == default.files


def test_weights_only_import_exports_weights(tmp_path):
    """A run imported without optimizer state exports its weights alone, and reads back."""
    src = tmp_path / "ucp"
    jax_ucp.convert(FIX / "gpt_tp2", src, importing=MegatronOptions(vocab_size=VOCAB))
    done = jax_ucp.export(src, tmp_path / "out", MegatronExport(make_vocab_size_divisible_by=8))
    assert done.tensors == 17
    common = torch_zip.load_torch_file(tmp_path / "out" / "common.pt", legacy.LEGACY_CLASSES)
    assert "optimizer" not in common and common["iteration"] == 0
    assert jax_ucp.diff(src, _reimported(tmp_path / "out")).identical


@pytest.mark.parametrize(
    "legacy_run",
    [
        "legacy_llama_tp2_synthetic",
        "legacy_gpt_distopt_pp2dp2_synthetic",
        "legacy_moe_ep2_synthetic",
        "legacy_moe_grouped_ep2_synthetic",
    ],
)
def test_legacy_import_exports_stacked(tmp_path, legacy_run):
    """A legacy Megatron-LM import (per-layer names, ``input_layernorm``; MoE experts as
    ``local_experts.<e>.*`` or grouped-GEMM ``weight1`` / ``weight2``) exports as megatron-core
    writes torch_dist: layers (and experts) stacked ``[L, ...]`` / ``[L, E, ...]``, norms under
    ``linear_qkv.layer_norm_*`` / ``linear_fc1.layer_norm_*`` (the tests' own name map,
    ``reference_value``); every leaf, masters and moments included, is its layer of the
    re-import bit for bit, and the re-import is the import of megatron-core's own torch_dist
    save of the same model (the fixture's twin)."""
    src = tmp_path / "legacy"
    jax_ucp.convert(FIX / legacy_run, src, importing=MegatronOptions(vocab_size=VOCAB))
    jax_ucp.export(src, tmp_path / "out", MegatronExport(tp=2, make_vocab_size_divisible_by=8))
    before, after = jax_ucp.restore(src), jax_ucp.restore(_reimported(tmp_path / "out"))
    state = before.get("opt_state", {})
    trees = [(before.get(t, {}), after.get(t, {})) for t in ("params", "model_params")]
    trees += [(state[m], after["opt_state"][m]) for m in ("mu", "nu") if m in state]
    leaves = 0
    for was, now in trees:
        stacked = {k: np.asarray(v) for k, v in now.items()}
        for name, value in was.items():
            got = reference_value(name, stacked)[1]
            assert_bit_equal(got, np.asarray(value), name)
            leaves += 1
    assert leaves == len(jax_ucp.inspect(src).tensors) - ("count" in state)
    if "count" in state:
        assert int(after["opt_state"]["count"]) == int(state["count"])
    twin = reference_of(legacy_run)  # megatron-core's own torch_dist save of the same model
    if twin != legacy_run:
        jax_ucp.convert(FIX / twin, tmp_path / "twin", importing=MegatronOptions(vocab_size=VOCAB))
        assert jax_ucp.diff(tmp_path / "twin", tmp_path / "out.ucp").identical


def test_continued_run_exports_with_the_imported_record(tmp_path):
    """A run continued in JAX and saved by jax_ucp (no Megatron record of its own) exports with
    ``run_record=`` the import it continued: its values, its step as the iteration and the
    groups' step, the scheduler and consumed samples advanced by the steps taken (a global batch
    each, as Megatron-LM counts them)."""
    src = tmp_path / "run"
    shutil.copytree(FIX / "gpt_distopt_dp2", src)  # megatron-core's save + Megatron-LM's common
    shutil.copyfile(FIX / "gpt_distopt_dp2_scheduler_synthetic.common.pt", src / "common.pt")
    jax_ucp.convert(src, tmp_path / "imported", importing=MegatronOptions(vocab_size=VOCAB))
    tree = jax_ucp.restore(tmp_path / "imported")
    tree["opt_state"]["count"] = tree["opt_state"]["count"] + 3  # three steps later
    tree["params"]["output_layer.weight"] = tree["params"]["output_layer.weight"] * 0.5
    jax_ucp.save(tmp_path / "continued", tree)
    with pytest.raises(RequestError, match="give run_record="):
        jax_ucp.export(tmp_path / "continued", tmp_path / "out", MegatronExport())
    hyper = MegatronExport(args={"lr": 1e-3, "weight_decay": 0.1})  # megatron-core's two groups
    jax_ucp.export(tmp_path / "continued", tmp_path / "default", hyper)
    common = torch_zip.load_torch_file(tmp_path / "default" / "common.pt", legacy.LEGACY_CLASSES)
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["weight_decay"], g["lr"], g["step"]) for g in groups] == [
        (1.0, 0.1, 1e-3, 5.0),
        (0.0, 0.0, 1e-3, 5.0),
    ]
    record = MegatronExport(run_record=tmp_path / "imported", args={"seed": 7})
    jax_ucp.export(tmp_path / "continued", tmp_path / "out", record)
    assert jax_ucp.diff(tmp_path / "continued", _reimported(tmp_path / "out")).identical
    common = torch_zip.load_torch_file(tmp_path / "out" / "common.pt", legacy.LEGACY_CLASSES)
    saved = torch_zip.load_torch_file(src / "common.pt", legacy.LEGACY_CLASSES)
    assert common["iteration"] == 5 and saved["iteration"] == 2
    assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {5.0}
    batch = legacy.args_dict(saved["args"])["global_batch_size"]
    scheduler = common["opt_param_scheduler"]
    assert scheduler["num_steps"] == saved["opt_param_scheduler"]["num_steps"] + 3 * batch
    assert {k: v for k, v in scheduler.items() if k != "num_steps"} == {
        k: v for k, v in saved["opt_param_scheduler"].items() if k != "num_steps"
    }
    args, before = legacy.args_dict(common["args"]), legacy.args_dict(saved["args"])
    assert args["consumed_train_samples"] == before["consumed_train_samples"] + 3 * batch
    assert (args["lr"], args["clip_grad"], args["seed"]) == (before["lr"], before["clip_grad"], 7)


def test_an_iteration_that_disagrees_with_the_optimizer_step_is_not_written(imported, tmp_path):
    """common.pt's iteration is the optimizer step (2): another one given (as iteration= or
    args={'iteration': ...}) is refused, as is a run record of a later step than the
    checkpoint's (a record of another run); nothing is written."""
    for options in (MegatronExport(iteration=3), MegatronExport(args={"iteration": 1})):
        with pytest.raises(RequestError, match=r"the optimizer is at step 2 .* iteration is 2"):
            jax_ucp.export(imported, tmp_path / "out", options)
    done = jax_ucp.export(imported, tmp_path / "ok", MegatronExport(iteration=2))
    common = torch_zip.load_torch_file(tmp_path / "ok" / "common.pt", legacy.LEGACY_CLASSES)
    assert common["iteration"] == 2 and done.tensors == 36
    tree = jax_ucp.restore(imported)
    tree["opt_state"]["count"] = tree["opt_state"]["count"] - 1  # before the record's step
    jax_ucp.save(tmp_path / "earlier", tree)
    with pytest.raises(RequestError, match=r"at optimizer step 2, after this checkpoint's 1"):
        jax_ucp.export(tmp_path / "earlier", tmp_path / "out", MegatronExport(run_record=imported))
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def scheduled_import(tmp_path_factory) -> Path:
    """The scheduler run (megatron-core's save with Megatron-LM's common state) imported."""
    root = tmp_path_factory.mktemp("scheduled")
    shutil.copytree(FIX / "gpt_distopt_dp2", root / "run")
    shutil.copyfile(FIX / "gpt_distopt_dp2_scheduler_synthetic.common.pt", root / "run/common.pt")
    jax_ucp.convert(root / "run", root / "ucp", importing=MegatronOptions(vocab_size=VOCAB))
    jax_ucp.export(root / "ucp", root / "intact", MegatronExport())  # its record exports
    return root / "ucp"


def _edited(ucp: Path, dst: Path, change) -> Path:
    """A copy of ``ucp`` whose ucp.json's recorded source ``change`` edited."""
    shutil.copytree(ucp, dst)
    doc = json.loads((dst / "ucp.json").read_text())
    change(doc["source"], doc["source"]["megatron_optimizer"])
    (dst / "ucp.json").write_text(json.dumps(doc))
    return dst


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s, r: r["args"].update(lr=0.02), r"disagree on max_lr: .*args\.lr = 0\.02"),
        (lambda s, r: r["param_groups"][1].update(betas=[0.8, 0.95]), r"per-parameter betas"),
        (lambda s, r: r["param_groups"][0].update(lr=0.02), r"param_groups\[0\]\.lr 0\.02 is n"),
        (lambda s, r: s.update(iteration=3), r"on iteration: .*\.iteration = 2; source\.itera"),
        (lambda s, r: r["param_groups"][1].pop("amsgrad"), r"other fields \(\['amsgrad'\]\)"),
        (lambda s, r: r["param_groups"][0].update(eps="x"), r"param_groups\[0\]\.eps = 'x'"),
        (lambda s, r: r["args"].update(bf16="x"), r"args\.bf16 = 'x': expected true or false"),
        (lambda s, r: r["args"].update(train_iters=1e308), r"train_iters = 1e\+308: .*integer"),
        (lambda s, r: r["opt_param_scheduler"].update(num_steps=12), r"num_steps 12 is not"),
        (  # Megatron-LM's load_state_dict reads it (KeyError): written before (probe 8)
            lambda s, r: r["opt_param_scheduler"].pop("lr_warmup_steps"),
            r"opt_param_scheduler has no lr_warmup_steps \(nor an older name",
        ),
    ],
)
def test_a_run_record_whose_records_disagree_is_not_exported(
    scheduled_import, tmp_path, change, match
):
    """ucp.json's recorded run is what common.pt passes on to Megatron-LM's resume: its args,
    scheduler and param groups must be one run's (read as a continuation reads them), each
    field of its kind, or the export is refused naming them, nothing written (before: written
    as recorded); the intact record exports."""
    src = _edited(scheduled_import, tmp_path / "edited", change)
    with pytest.raises(jax_ucp.UCPError, match=r"ucp\.json \(the run record\)") as raised:
        jax_ucp.export(src, tmp_path / "out", MegatronExport())
    assert raised.match(match)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_refusals(imported, tmp_path):
    """Names megatron-core does not use, a record of no Megatron run, a bad option: refused
    before anything is written."""
    save_small_tree(tmp_path / "flax")
    with pytest.raises(RequestError, match="has no megatron-core name"):
        jax_ucp.export(tmp_path / "flax", tmp_path / "out", MegatronExport())
    with pytest.raises(RequestError, match="records no Megatron run"):
        jax_ucp.export(imported, tmp_path / "out", MegatronExport(run_record=tmp_path / "flax"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(RequestError, match="tp=0"):
        MegatronExport(tp=0)
    with pytest.raises(RequestError, match="etp=0"):
        MegatronExport(etp=0)


def test_a_layout_megatron_core_cannot_build_is_refused(imported, tmp_path):
    """Layers that do not split evenly over ``pp`` x ``vpp`` stages (the 2-layer run at PP 2 x
    VPP 2, PP 3), a virtual pipeline without a pipeline: refused naming the setting, the
    checkpoint's ucp.json and the tensor its layers were counted by, nothing written (megatron-
    core would assert at the load); Megatron-LM's uneven split, given in ``args``, exports."""
    refused = [
        (
            MegatronExport(pp=2, vpp=2),
            r"pp=2 x vpp=2: the checkpoint at .*ucp\.json\) holds 2 "
            r"layers \('decoder\.layers\.[\w.]+' \[2, .*cannot split in 4 equal parts",
        ),
        (MegatronExport(pp=3), r"pp=3: .* holds 2 layers .*in 3 equal"),
        (MegatronExport(pp=1, vpp=2), r"vpp=2: megatron-core's virtual pipeline needs pp > 1"),
    ]
    for options, match in refused:
        with pytest.raises(RequestError, match=match):
            jax_ucp.export(imported, tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
    uneven = MegatronExport(pp=3, args={"decoder_first_pipeline_num_layers": 0})
    assert jax_ucp.export(imported, tmp_path / "out", uneven).tensors == 36


def test_moe_optimizer_state_without_the_experts_param_groups_is_refused(tmp_path):
    """A MoE run continued in JAX (no record of its optimizers) cannot make megatron-core's
    expert-parallel param groups (EP > 1) from ``args``: refused naming the experts, nothing
    written; the record of the run it was imported from gives them. 4 experts over EP 3:
    refused naming the router they were counted by. The expert TP size goes to ``args``."""
    src = MOE / "moe_distopt_ep2_fully_reshardable"
    jax_ucp.convert(src, tmp_path / "ucp", importing=MegatronOptions(vocab_size=VOCAB))
    jax_ucp.save(tmp_path / "continued", jax_ucp.restore(tmp_path / "ucp"))
    hyper = MegatronExport(ep=2, args={"lr": 0.1})
    with pytest.raises(RequestError, match=r"ep=2: .*experts' param groups .*experts\.linear_fc1"):
        jax_ucp.export(tmp_path / "continued", tmp_path / "out", hyper)
    assert not (tmp_path / "out").exists()
    with pytest.raises(
        RequestError,
        match=r"ep=3: .*ucp\.json\) holds 4 experts \('decoder\."
        r"layers\.mlp\.router\.weight' \[1, 4, 32\].* in 3 equal parts",
    ):
        jax_ucp.export(tmp_path / "ucp", tmp_path / "out", MegatronExport(ep=3))
    assert not (tmp_path / "out").exists()
    record = MegatronExport(ep=2, etp=1, run_record=tmp_path / "ucp")
    assert jax_ucp.export(tmp_path / "continued", tmp_path / "out", record).tensors == 4 * 10
    common = torch_zip.load_torch_file(tmp_path / "out" / "common.pt", legacy.LEGACY_CLASSES)
    args = legacy.args_dict(common["args"])
    assert (args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (2, 1)
    assert jax_ucp.export(tmp_path / "ucp", tmp_path / "ep1", MegatronExport()).tensors == 40


def _adam(before: dict, grads: dict, name: str, step: int, lr=0.01, b1=0.9, b2=0.95, eps=1e-8):
    """torch's Adam (no weight decay) from ``before``'s state at ``step``, in float64."""
    g = np.asarray(grads[name], np.float64)
    m = b1 * np.asarray(before["opt_state"]["mu"][name], np.float64) + (1 - b1) * g
    v = b2 * np.asarray(before["opt_state"]["nu"][name], np.float64) + (1 - b2) * g * g
    master = np.asarray(before["params"][name], np.float64)
    return master - lr / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + eps), m, v


def _loss(logits: np.ndarray, tokens: np.ndarray, rows: int) -> float:
    """Megatron's next-token cross entropy of the JAX ``logits``, its softmax over the padded
    vocab of ``rows`` (the padded rows' logits are 0; unpadded the bf16 loss is 4.7e-2 off)."""
    logits = np.concatenate([logits, np.zeros((*logits.shape[:2], rows - VOCAB))], axis=-1)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    labels = np.roll(tokens, -1, axis=1)
    picked = np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return float((log_z - picked).mean())


def _mcore_continue(export: Path, out: Path, cfg: dict, world: int) -> dict:
    """tests/exporters/mcore_continue.py run on ``export`` (its result.json; None: no step)."""
    script = Path(__file__).with_name("mcore_continue.py")
    generator = Path(REPO) / "tools" / "fixtures" / "make_megatron_fixtures.py"
    args = [str(generator), str(export), str(out), json.dumps(cfg), str(world), str(free_port())]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = out / "result.json"
    return json.loads(result.read_text()) if result.exists() else None


@pytest.mark.torch
@pytest.mark.slow  # 1-3 min each: megatron-core built and stepped; CI runs it once (high end)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 1), (1, 2)])
def test_megatron_core_loads_and_continues(imported, tmp_path, tp, pp):
    """megatron-core's ``dist_checkpointing.load`` reads the export into a GPTModel and its
    DistributedOptimizer (TP ``tp``, PP ``pp``: each stage its layers of the stacked
    ``decoder.layers.*``, DP 2 // (tp * pp)): saved again by megatron-core, it imports
    bit-identical to the JAX checkpoint; one training step on CPU (forward, backward, Adam)
    continues from it: step 3, each master and moment what Adam makes of the loaded state and
    the gradient megatron-core computed."""
    pytest.importorskip("megatron.core")
    dst = tmp_path / "export"
    jax_ucp.export(imported, dst, MegatronExport(tp=tp, pp=pp, make_vocab_size_divisible_by=8))
    cfg = dict(kind="llama", tp=tp, pp=pp, tied=False, bf16=True)
    result = _mcore_continue(dst, tmp_path, cfg, world=2)
    assert result["ok"] and result["iteration"] == 2
    args = result["args"]
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == (tp, pp)
    loaded = _reimported(tmp_path / "loaded")
    assert jax_ucp.diff(imported, loaded).identical
    before, after = jax_ucp.restore(imported), jax_ucp.restore(_reimported(tmp_path / "stepped"))
    grads = jax_ucp.restore(_reimported(tmp_path / "grads"))["params"]
    assert int(after["opt_state"]["count"]) == 3
    # the loss megatron-core computed is the JAX model's on the same weights (bf16 compute
    # there), its softmax over Megatron's padded vocab (the padded rows' logits are 0)
    tokens = np.asarray(result["tokens"], np.int32)
    cfg = lm_config(RUN, max_position_embeddings=32)
    weights = {k: np.asarray(v, np.float32) for k, v in before["model_params"].items()}
    logits = np.asarray(TransformerLM(cfg).apply(from_megatron(weights, cfg), tokens), np.float64)
    assert abs(result["loss"] - _loss(logits, tokens, result["vocab_rows"])) < 5e-3
    assert set(grads) == set(before["params"])
    for name in grads:
        master, m, v = _adam(before, grads, name, step=3)
        moved = np.abs(master - np.asarray(before["params"][name], np.float64)).max()
        assert moved > 1e-3, name  # the step moved it: the check below can fail
        np.testing.assert_allclose(after["params"][name], master, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(after["opt_state"]["mu"][name], m, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(after["opt_state"]["nu"][name], v, atol=1e-8, err_msg=name)


@pytest.mark.torch
@pytest.mark.slow  # 1-3 min each: megatron-core built and stepped; CI runs it once (high end)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "run, ep", [("moe_distopt_ep2", 2), ("moe_distopt_ep2", 1), ("moe_grouped_distopt_ep2", 2)]
)
def test_megatron_core_loads_and_continues_moe(tmp_path, run, ep):
    """A MoE run (4 experts over EP 2; sequential or grouped-GEMM experts, one torch_dist layout
    ``experts.experts.linear_fc{1,2}.weight`` [L, E, ...]) exported with its two optimizers'
    param groups (megatron-core's ChainedOptimizer: dense, then expert-parallel) is loaded by
    megatron-core into the model and its DistributedOptimizer at EP ``ep`` (DP 2 // ep; at
    EP 1 one optimizer): saved again, it imports bit-identical; the sequential one (grouped GEMM's forward needs CUDA) takes one
    step: step 3, each master and moment what Adam makes of the loaded state and megatron-core's
    gradient, the loss the JAX model's on the same weights."""
    experts = pytest.importorskip("megatron.core.transformer.moe.experts")
    if "grouped" in run and not hasattr(experts, "GroupedMLP"):
        pytest.skip("megatron-core >= 0.19 has no GroupedMLP (its TEGroupedMLP needs TE)")
    src = tmp_path / "ucp"
    jax_ucp.convert(
        MOE / f"{run}_fully_reshardable", src, importing=MegatronOptions(vocab_size=VOCAB)
    )
    dst, grouped = tmp_path / "export", "grouped" in run
    jax_ucp.export(src, dst, MegatronExport(ep=ep, make_vocab_size_divisible_by=8))
    common = torch_zip.load_torch_file(dst / "common.pt", legacy.LEGACY_CLASSES)
    chained = common["optimizer"] if ep > 1 else {0: common["optimizer"]}
    groups = [
        [g["is_expert_parallel"] for g in o["optimizer"]["param_groups"]] for o in chained.values()
    ]
    assert groups == ([[False, False], [True]] if ep > 1 else [[False, False]])
    args = legacy.args_dict(common["args"])
    assert (args["num_experts"], args["expert_model_parallel_size"]) == (4, ep)
    cfg = dict(kind="moe", tp=1, ep=ep, tied=False, grouped=grouped)
    result = _mcore_continue(dst, tmp_path, cfg, world=2)
    assert jax_ucp.diff(src, _reimported(tmp_path / "loaded")).identical
    if grouped:
        assert result is None
        return
    assert result["ok"] and result["iteration"] == 2
    before, after = jax_ucp.restore(src), jax_ucp.restore(_reimported(tmp_path / "stepped"))
    grads = jax_ucp.restore(_reimported(tmp_path / "grads"))["params"]
    assert int(after["opt_state"]["count"]) == 3 and set(grads) == set(before["params"])
    tokens = np.asarray(result["tokens"], np.int32)
    cfg = lm_config("moe_ep2", max_position_embeddings=32)
    weights = {k: np.asarray(v, np.float32) for k, v in before["params"].items()}
    logits = np.asarray(TransformerLM(cfg).apply(from_megatron(weights, cfg), tokens), np.float64)
    assert abs(result["loss"] - _loss(logits, tokens, result["vocab_rows"])) < 1e-4
    for name in grads:
        # megatron-core scales each gradient by 1 / DP (2) before reducing it over its DP group:
        # a dense one (2 ranks, one batch) sums back; an expert's at EP 2 (a group of one rank,
        # the tokens of both) stays halved
        scale = 0.5 if ep > 1 and ".experts." in name else 1.0
        master, m, v = _adam(before, {name: np.asarray(grads[name]) * scale}, name, step=3)
        np.testing.assert_allclose(after["params"][name], master, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(after["opt_state"]["mu"][name], m, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(after["opt_state"]["nu"][name], v, atol=1e-8, err_msg=name)


def _deeper(tree: dict, scale: float = 0.9) -> dict:
    """A legacy import's ``tree`` with its layers ``decoder.layers.<i>.*`` (every root: params,
    masters, moments) followed by a scaled copy of themselves: 2L layers, each different
    (_synthetic)."""

    def grow(leaves: dict) -> dict:
        count = 1 + max(int(k.split(".")[2]) for k in leaves if k.split(".")[2].isdigit())
        out = dict(leaves)
        for k, v in leaves.items():
            copy = np.asarray(v) * np.asarray(scale, v.dtype)
            parts = k.split(".")
            if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
                out[".".join([*parts[:2], str(int(parts[2]) + count), *parts[3:]])] = copy
        return out

    out = {root: grow(tree[root]) for root in ("params", "model_params") if root in tree}
    state = dict(tree["opt_state"])
    out["opt_state"] = {**state, "mu": grow(state["mu"]), "nu": grow(state["nu"])}
    return out


def _with_shared_experts(tree: dict, size: int) -> dict:
    """A MoE ``tree`` with megatron-core's shared experts added to each layer (SwiGLU
    ``linear_fc1`` [L, 2S, h], ``linear_fc2`` [L, h, S]; seeded values and moments, _synthetic)."""
    router = np.asarray(tree["params"]["decoder.layers.mlp.router.weight"])  # [L, E, h]
    layers, hidden = router.shape[0], router.shape[2]
    rng = np.random.default_rng(0)
    shapes = {"linear_fc1": (layers, 2 * size, hidden), "linear_fc2": (layers, hidden, size)}
    for part, shape in shapes.items():
        name = f"decoder.layers.mlp.shared_experts.{part}.weight"
        tree["params"][name] = rng.normal(0, 0.05, shape).astype(np.float32)
        tree["opt_state"]["mu"][name] = rng.normal(0, 1e-3, shape).astype(np.float32)
        tree["opt_state"]["nu"][name] = (rng.normal(0, 1e-3, shape) ** 2).astype(np.float32)
    return tree


#: open (megatron-core 0.16.1, CPU): the tied cases load and run, but the tied embedding's fp32
#: master (and moments) megatron-core saves back are the export's shifted by 2 rows (64 elements,
#: its "param range exceeds unpadded buffer by 64 elements" warning): not yet explained
TIED_SHIFT = "tied embedding's master saved back shifted by 2 rows after megatron-core's load"
MOE_RUN = MOE / "moe_distopt_ep2_fully_reshardable"
LEGACY_PP2 = FIX / "legacy_gpt_distopt_pp2dp2_synthetic"  # tied embeddings, PP2, Adam
#: layout -> (source, synthetic edit, export options, the megatron-core build, the JAX config)
LAYOUTS = {
    "moe_etp2": (MOE_RUN, None, dict(tp=2, etp=2), dict(kind="moe", tp=2, etp=2), ("moe_ep2", {})),
    "moe_shared_ep2": (
        MOE_RUN,
        lambda tree: _with_shared_experts(tree, 16),
        dict(ep=2),
        dict(kind="moe", tp=1, ep=2, shared=16),
        ("moe_ep2", dict(moe_shared_expert_intermediate_size=16)),
    ),
    "tied_pp2": (LEGACY_PP2, None, dict(pp=2), dict(kind="gpt", tp=1, pp=2), (LEGACY_PP2.name, {})),
    "tied_pp2_vpp2": (
        LEGACY_PP2,
        _deeper,
        dict(pp=2, vpp=2),
        dict(kind="gpt", tp=1, pp=2, vpp=2, layers=4, load_only=True),
        (LEGACY_PP2.name, dict(num_layers=4)),
    ),
}


@pytest.mark.torch
@pytest.mark.slow  # 1-2 min each: megatron-core built and stepped; CI runs it once (high end)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(name, marks=pytest.mark.xfail(reason=TIED_SHIFT, run=False))  # 4 min each
        if name.startswith("tied")
        else name
        for name in LAYOUTS
    ],
)
def test_megatron_core_loads_and_continues_layout(tmp_path, layout):
    """The layouts megatron-core users run beyond TP / PP / EP: experts split over expert TP 2
    (``expert_tensor_parallel_size``), shared experts beside the routed ones at EP 2, tied
    embeddings over PP 2 (the embedding on the first stage, the output layer that reads it on
    the last), and virtual pipeline chunks (``model0`` / ``model1``, 4 layers over PP 2 x VPP
    2). megatron-core's ``dist_checkpointing.load`` reads the export into the model built that
    way and its DistributedOptimizer; saved again it imports bit-identical to the export's own
    import; one step on CPU continues it (not the VPP one: loaded and saved only): the loss the JAX model's on the same weights, each
    master and moment what Adam makes of the loaded state and megatron-core's gradient (the
    tied one summed over both stages)."""
    pytest.importorskip("megatron.core")
    run, edit, options, cfg, (config, over) = LAYOUTS[layout]
    src = tmp_path / "ucp"
    jax_ucp.convert(run, src, importing=MegatronOptions(vocab_size=VOCAB))
    record = {}
    if edit is not None:  # a run continued in JAX: the import's record of the run
        jax_ucp.save(tmp_path / "edited", edit(jax_ucp.restore(src)))
        src, record = tmp_path / "edited", {"run_record": src}
    dst = tmp_path / "export"
    jax_ucp.export(src, dst, MegatronExport(make_vocab_size_divisible_by=8, **options, **record))
    cfg = {"ep": 1, "tied": "tied" in layout, **cfg}
    result = _mcore_continue(dst, tmp_path, cfg, world=2)
    exported = _reimported(dst)  # (a legacy import's per-layer names stacked, as megatron-core's)
    assert jax_ucp.diff(exported, _reimported(tmp_path / "loaded")).identical
    if cfg.get("load_only"):  # VPP: loaded and saved again, not stepped (see MEGATRON.md)
        assert result is None
        return
    assert result["ok"] and result["iteration"] == 2
    before, after = jax_ucp.restore(exported), jax_ucp.restore(_reimported(tmp_path / "stepped"))
    grads = jax_ucp.restore(_reimported(tmp_path / "grads"))["params"]
    assert int(after["opt_state"]["count"]) == 3 and set(grads) == set(before["params"])
    tokens = np.asarray(result["tokens"], np.int32)
    lm = lm_config(config, max_position_embeddings=32, **over)
    weights = {k: np.asarray(v, np.float32) for k, v in before["params"].items()}
    logits = np.asarray(TransformerLM(lm).apply(from_megatron(weights, lm), tokens), np.float64)
    assert abs(result["loss"] - _loss(logits, tokens, result["vocab_rows"])) < 1e-4
    for name in grads:  # at EP 2 an expert's gradient stays halved (see the MoE test above)
        scale = 0.5 if cfg["ep"] > 1 and ".experts.experts." in name else 1.0
        master, m, v = _adam(before, {name: np.asarray(grads[name]) * scale}, name, step=3)
        assert np.abs(master - np.asarray(before["params"][name], np.float64)).max() > 1e-4, name
        np.testing.assert_allclose(after["params"][name], master, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(after["opt_state"]["mu"][name], m, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(after["opt_state"]["nu"][name], v, atol=1e-8, err_msg=name)
