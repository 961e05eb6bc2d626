"""An imported Hugging Face Llama (the real Trainer + DeepSpeed fixture) onto a mesh: the shipped
``hf_llama`` spec names the logical axes (embed, mlp, heads, vocab) of what it restores, so
``restore(mesh=, rules=)`` shards it; a rule that matches no name warns (restore) and is named
(plan, ``jax-ucp plan``) instead of silently replicating."""

from __future__ import annotations

import json
import os
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ucp
from jax_ucp.language import load_spec
from jax_ucp.models import LMConfig
from tests.ucp_testing import REPO

pytestmark = pytest.mark.timeout(300)
SRC = os.path.join(REPO, "tests", "fixtures", "hf_trainer", "llama_z2_dp2", "checkpoint-2")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return jax_ucp.convert(SRC, str(tmp_path_factory.mktemp("mesh") / "ucp"))


@pytest.fixture(scope="module")
def spec():
    with open(os.path.join(SRC, "config.json")) as f:
        cfg = LMConfig.from_hf_llama(json.load(f))
    return load_spec("hf_llama", **cfg.head_settings)


def _mesh():
    devices = np.array(jax.devices()[:2])
    if devices.size < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return Mesh(devices, ("data",))


def test_imported_llama_shards_by_its_logical_names(imported, spec):
    mesh = _mesh()
    rules = [("embed", "data")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        got = jax_ucp.restore(imported, spec=spec, mesh=mesh, rules=rules)
    plain = jax_ucp.restore(imported, spec=spec)
    emb = got["params"]["wte"]["embedding"]
    assert emb.sharding.spec == P(None, "data")
    assert got["params"]["layers_0"]["mlp"]["fc1"]["kernel"].sharding.spec == P("data", None)
    assert got["params"]["ln_f"]["scale"].sharding.spec == P("data")
    mu = got["opt_state"]["0"]["mu"]["layers_0"]["attn"]["qkv"]["kernel"]
    assert mu.sharding.spec == P("data", None)  # moments follow their weight's names
    assert np.asarray(emb).tobytes() == np.asarray(plain["params"]["wte"]["embedding"]).tobytes()


def test_rule_matching_nothing_warns_and_plan_names_it(imported, spec, capsys):
    mesh = _mesh()
    with pytest.warns(jax_ucp.ReplicationWarning, match=r"'embed'.*logical axis"):
        jax_ucp.restore(imported, mesh=mesh, rules=[("embed", "data")])  # no spec: no names
    with pytest.warns(jax_ucp.ReplicationWarning, match="'embd'"):
        jax_ucp.restore(imported, spec=spec, mesh=mesh, rules=[("embd", "data")], strict=False)
    with pytest.warns(jax_ucp.ReplicationWarning):
        plan = jax_ucp.plan(imported, mesh=mesh, rules=[("embed", "data")])
    assert plan.unmatched_rules == ("embed",)
    assert (
        jax_ucp.plan(imported, mesh=mesh, rules=[("embed", "data")], spec=spec).unmatched_rules
        == ()
    )


def test_cli_plan_says_the_rule_matched_nothing(imported):
    """``jax-ucp plan --rules embed=data`` on an imported checkpoint (no names without a spec)
    says the rule matched nothing, beside the replicated count."""
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    r = CliRunner().invoke(app, ["plan", imported, "--mesh", "data=2", "--rules", "embed=data"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "rules matching no tensor's logical axis names (1): embed" in text
    assert "replicated on every device" in text


MEGATRON = os.path.join(REPO, "tests", "fixtures", "megatron", "gpt_tp2")
RULES = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]


def test_rules_that_shard_nothing_name_the_tensors_and_the_spec_for_their_names():
    """A Megatron import restored with the docs' rules and no spec: the warning names the
    tensors left whole (2+ dims, no names) and the shipped spec whose rules cover Megatron's
    names (not hf_llama); restored with that spec, nothing is said and they are sharded."""
    from tests.ucp_testing import mesh

    m = mesh((2, 4), ("data", "model"))
    with pytest.warns(jax_ucp.ReplicationWarning) as said:
        jax_ucp.restore(MEGATRON, mesh=m, rules=RULES)
    text = " ".join(str(w.message) for w in said)
    assert "15 tensor(s) of 2 or more dimensions carry no logical axis names" in text
    assert "'params/decoder.layers.mlp.linear_fc1.weight'" in text
    assert "spec='megatron_gpt'" in text and "hf_llama" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_ucp.ReplicationWarning)
        got = jax_ucp.restore(MEGATRON, mesh=m, rules=RULES, spec="megatron_gpt")
    kernel = got["params"]["layers_0"]["mlp"]["fc1"]["kernel"]
    assert kernel.sharding.spec == P("data", "model")


def test_a_spec_that_names_no_axes_is_told_to_name_them():
    """A spec of the user's without ``axes`` (megatron_gpt's rules, names dropped): the warning
    names the spec and the tensors, and says to add ``axes`` to its restore rules."""
    import dataclasses

    from tests.ucp_testing import mesh

    shipped = load_spec("megatron_gpt")
    bare = dataclasses.replace(
        shipped,
        name="my_gpt",
        restore=tuple(dataclasses.replace(r, axes=None) for r in shipped.restore),
    )
    with pytest.warns(jax_ucp.ReplicationWarning) as said:
        jax_ucp.plan(MEGATRON, mesh=mesh((2, 4), ("data", "model")), rules=RULES, spec=bare)
    text = " ".join(str(w.message) for w in said)
    assert "'params/layers_0/mlp/fc1/kernel'" in text or "(11 in all)" in text
    assert "the spec 'my_gpt' gives them no axes: add axes = [...]" in text
    assert "spec='megatron_gpt'" not in text


def test_names_no_shipped_spec_covers_are_told_how_to_name_them(tmp_path):
    """A checkpoint of the user's own (no names, saved from host arrays) restored with rules:
    the warning names the whole tensor and says how to name its axes, no shipped spec."""
    from tests.ucp_testing import mesh

    path = jax_ucp.save(tmp_path / "c", {"params": {"w": np.ones((8, 8), np.float32)}})
    with pytest.warns(jax_ucp.ReplicationWarning) as said:
        jax_ucp.restore(path, mesh=mesh((2, 4), ("data", "model")), rules=RULES)
    text = " ".join(str(w.message) for w in said)
    assert "1 tensor(s) of 2 or more dimensions carry no logical axis names" in text
    assert "'params/w'" in text and "a spec whose restore rules give them axes" in text
