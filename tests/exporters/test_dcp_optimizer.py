"""torch DCP with the optimizer (``TorchDcpExport(optimizer=...)``), torch-free: the layout
``get_state_dict(..., flatten_optimizer_state_dict=True)`` gives, read back by jax_ucp's own DCP
importer (which reads torch's saves of that layout) into the same weights, moments, step and
param groups; the groups checked against the parameters before anything is written.
tests/exporters/test_dcp_optimizer_torch.py has torch load one into a model and AdamW."""

from __future__ import annotations

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.exporters import TorchDcpExport
from jax_ucp.errors import RequestError

GROUP = {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "foreach": None}


def _run(path):
    """A torch-named run as an import of one holds it: params, Adam's moments, the count."""
    rng = np.random.default_rng(0)
    shapes = {"embed.weight": (6, 4), "layer.0.weight": (4, 4), "norm.weight": (4,)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    mu = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    nu = {k: rng.random(s).astype(np.float32) for k, s in shapes.items()}
    tree = {"params": params, "opt_state": {"mu": mu, "nu": nu, "count": np.int32(7)}}
    return jax_ucp.save(str(path), tree)


@pytest.mark.parametrize("model, flat", [("model", True), ("", True), ("model", False)])
def test_the_export_reads_back_as_the_run_with_its_groups(tmp_path, model, flat):
    """Exported under ``model.`` (``get_state_dict``'s) or top-level (torchtitan's), groups per
    parameter or torch's nested list, then imported: every weight and moment bit for bit, the
    step, the two groups' values."""
    ckpt = _run(tmp_path / "run")
    groups = [
        {**GROUP, "params": ["embed.weight", "layer.0.weight"]},
        {**GROUP, "weight_decay": 0.0, "params": ["norm.weight"]},
    ]
    options = TorchDcpExport(
        optimizer="optimizer", model=model, param_groups=groups, flatten_optimizer_state_dict=flat
    )
    done = jax_ucp.export(ckpt, tmp_path / "dcp", options)
    assert done.tensors == 12 and done.skipped == []
    back = jax_ucp.convert(tmp_path / "dcp", tmp_path / "back")
    diff = jax_ucp.diff(ckpt, back)
    assert diff.identical and diff.same == 10, diff  # the count too
    assert int(jax_ucp.restore(back)["opt_state"]["count"]) == 7
    recorded = jax_ucp.inspect(back).source["optimizer"]["param_groups"]
    assert sorted((g["weight_decay"], g["params"], g["betas"]) for g in recorded) == [
        (0.0, ["norm.weight"], [0.9, 0.95]),
        (0.1, ["embed.weight", "layer.0.weight"], [0.9, 0.95]),
    ]
    # the import's record is what a continued run writes back (run_record=); lr overridden
    again = TorchDcpExport(
        optimizer="optimizer", model=model, run_record=back, param_groups={"lr": 3e-4}
    )
    jax_ucp.export(ckpt, tmp_path / "again", again)
    twice = jax_ucp.convert(tmp_path / "again", tmp_path / "twice")
    assert jax_ucp.diff(back, twice).identical
    lrs = {g["lr"] for g in jax_ucp.inspect(twice).source["optimizer"]["param_groups"]}
    assert lrs == {3e-4}


def test_groups_that_do_not_fit_the_parameters_are_refused(tmp_path):
    """A name no parameter has, a parameter in no group or in two, no groups at all, options
    without optimizer=: refused naming them, nothing written."""
    ckpt = _run(tmp_path / "run")
    everyone = ["embed.weight", "layer.0.weight", "norm.weight"]
    cases = [
        ([{**GROUP, "params": [*everyone, "lm_head.weight"]}], r"'lm_head.weight' is no param"),
        ([{**GROUP, "params": everyone[:2]}], r"\['norm.weight'\] are in no group"),
        ([{**GROUP, "params": everyone}, {"params": ["norm.weight"]}], r"in two groups"),
        (None, r"records none .*give run_record="),
    ]
    for groups, message in cases:
        with pytest.raises(RequestError, match=message):
            options = TorchDcpExport(optimizer="optim", param_groups=groups)
            jax_ucp.export(ckpt, tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
    for wrong in ({"param_groups": GROUP}, {"flatten_optimizer_state_dict": False}):
        with pytest.raises(RequestError, match="need optimizer="):
            TorchDcpExport(**wrong)
    with pytest.raises(RequestError, match="True or False"):
        TorchDcpExport(optimizer="optim", flatten_optimizer_state_dict=0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(RequestError, match="without dots"):
        TorchDcpExport(optimizer="a.b")
    # a run without Adam's state: the plain export is there for its tensors
    jax_ucp.save(str(tmp_path / "w"), {"params": {"w": np.ones((2, 2), np.float32)}})
    with pytest.raises(RequestError, match=r"Adam moments"):
        jax_ucp.export(tmp_path / "w", tmp_path / "out", TorchDcpExport(optimizer="optim"))


@pytest.mark.parametrize("optimizer", ["optim", None])
def test_an_moe_spec_writing_experts_one_by_one_is_refused(tmp_path, optimizer):
    """A Qwen3-MoE flax tree exported with a family spec that knows only the files' per-expert
    names (the shipped one without its ``hf_names = "state_dict"`` rules: transformers 5's model
    fuses them) is refused naming an expert's name and the fused ones; nothing written. The
    shipped spec writes the fused names (tests/exporters/test_by_spec_dcp_torch.py)."""
    from jax_ucp._src.language import load_spec
    from jax_ucp._src.language.spec import spec_from_dict
    from tests.exporters.test_by_spec import random_tree

    cfg, name, tree = random_tree("qwen3_moe")
    ckpt = jax_ucp.save(str(tmp_path / "run"), {"params": tree})
    plain = load_spec(name, **cfg.head_settings).to_dict()
    plain["settings"].pop("hf_names")
    rules = [r for r in plain["restore"] if r.pop("when", {}) != {"hf_names": "state_dict"}]
    files_only = spec_from_dict({**plain, "restore": rules})
    groups = {"param_groups": GROUP} if optimizer else {}
    options = TorchDcpExport(spec=files_only, optimizer=optimizer, **groups)
    expert = r"'(params\.)?model\.layers\.\d+\.mlp\.experts\.\d+\.\w+\.weight'"
    with pytest.raises(RequestError, match=rf"one by one \({expert}.*experts\.gate_up_proj"):
        jax_ucp.export(ckpt, tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_a_tied_name_shares_its_parameters_bytes_and_verifies_against_it(tmp_path):
    """``tied=`` writes the name as the parameter's own storage entry (the tie is in the
    files): the export verifies against the checkpoint without that name (the tied name
    compared with its parameter), its import records the tie; against a checkpoint whose
    parameter differs, both names are problems."""
    ckpt = _run(tmp_path / "run")
    tied = TorchDcpExport(
        optimizer="optim", param_groups=GROUP, tied={"head.weight": "embed.weight"}
    )
    jax_ucp.export(ckpt, tmp_path / "dcp", tied)
    assert jax_ucp.verify(tmp_path / "dcp", against=ckpt) == []
    back = jax_ucp.convert(tmp_path / "dcp", tmp_path / "back")
    assert jax_ucp.inspect(back).source["optimizer"]["tied"] == {"head.weight": "embed.weight"}
    run = jax_ucp.restore(ckpt)
    run["params"]["embed.weight"][0, 0] += 1
    other = jax_ucp.save(str(tmp_path / "other"), run)
    bad = dict(jax_ucp.verify(tmp_path / "dcp", against=other))
    assert sorted(bad) == ["params/embed.weight", "params/head.weight"], bad
    assert "1 of 24 elements differ" in bad["params/head.weight"]


@pytest.mark.parametrize("borrower", ["optim.state.embed.weight.exp_avg", "model.head.weight"])
def test_only_a_tied_weight_may_share_a_storage_entry(tmp_path, borrower):
    """A moment, or a second trained weight, pointed at the embedding's entry (a tied alias's
    way) is refused naming both: only a weight without state may be another's."""
    from tests.importers.megatron.test_dcp import read_layout, write_layout

    ckpt = _run(tmp_path / "run")
    tied = TorchDcpExport(
        optimizer="optim", param_groups=GROUP, tied={"head.weight": "embed.weight"}
    )
    jax_ucp.export(ckpt, tmp_path / "dcp", tied)
    tensors, objects = read_layout(tmp_path / "dcp")
    if borrower == "model.head.weight":  # the alias given a state of its own
        for state in ("exp_avg", "exp_avg_sq"):
            tensors[f"optim.state.head.weight.{state}"] = tensors[
                f"optim.state.embed.weight.{state}"
            ]
    else:
        tensors[borrower] = tensors["model.embed.weight"]
    write_layout(tmp_path / "dcp", tensors, objects)
    with pytest.raises(jax_ucp.UCPError, match=r"model\.embed\.weight.*are one storage entry"):
        jax_ucp.convert(tmp_path / "dcp", tmp_path / "back")
