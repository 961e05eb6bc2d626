"""verl's Megatron backend (``MegatronCheckpointManager``): a layout built from verl's code
(``<run>/global_step_N/actor/dist_ckpt/`` + ``transformer_config.json``, the run's
``latest_checkpointed_iteration.txt``) around a folder megatron-core 0.17.1 wrote itself
(``tests/fixtures/megatron/mcore_versions``), read by the megatron importer and recorded as
verl's; compared with that folder's own import and with the run's live state."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.registry import detect_format
from jax_ucp._src.torchfiles.dcp import DcpItem, write_dcp
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.ucp_testing import REPO, assert_destination_untouched, run_cli

pytestmark = pytest.mark.timeout(180)
MCORE = os.path.join(REPO, "tests", "fixtures", "megatron", "mcore_versions")
DIST_CKPT = os.path.join(MCORE, "0.17.1", "gpt_distopt_dp2_fully_reshardable")
# the same seeded run's live state (tests/importers/megatron/test_versions.py)
TRUTH = os.path.join(MCORE, "0.19.2", "gpt_distopt_dp2_dp_zero_gather_scatter.truth.npz")
ACTOR = os.path.join("global_step_2", "actor")


def _verl_run(tmp_path, dist_ckpt: str = DIST_CKPT) -> str:
    """A verl run root laid out as verl's MegatronCheckpointManager and trainer write it."""
    run = tmp_path / "run"
    shutil.copytree(dist_ckpt, run / ACTOR / "dist_ckpt")
    (run / ACTOR / "transformer_config.json").write_text('{"num_layers": 2}')
    (run / ACTOR / "huggingface").mkdir()
    (run / ACTOR / "huggingface" / "config.json").write_text('{"vocab_size": 61}')
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    return str(run)


def _flat(tree, prefix="") -> dict[str, np.ndarray]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}/").items()}
    return {prefix[:-1]: np.asarray(tree)}


def _as_direct(tmp_path, src: str, dist_ckpt: str):
    """(the import of ``src``, its tree), checked bit-exact to megatron's of ``dist_ckpt``."""
    assert detect_format(src) == "verl"
    out = jax_ucp.convert(src, tmp_path / "ucp")
    direct = jax_ucp.convert(dist_ckpt, tmp_path / "direct", format="megatron")
    got, want = _flat(jax_ucp.restore(out)), _flat(jax_ucp.restore(direct))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), key
    return out, got


@pytest.mark.parametrize("version", ["0.13.1/gpt_tp2", "0.15.3/gpt_tp2", "0.19.2/gpt_tp2"])
def test_other_megatron_core_versions_import_as_their_folder(tmp_path, version):
    """0.15's .metadata pickled as megatron-core's MCoreMetadata, 0.19's without common.pt."""
    dist_ckpt = os.path.join(MCORE, version)
    _as_direct(tmp_path, _verl_run(tmp_path, dist_ckpt), dist_ckpt)


@pytest.mark.parametrize("entry", ["", "global_step_2", ACTOR])
def test_every_entry_point_imports_as_the_dist_ckpt_folder_itself(tmp_path, entry):
    """Run root (its tracker names step 2), step folder and actor/: detected as verl (the root's
    Megatron tracker and DeepSpeed-like global_step_N/ no longer make two formats), imported
    bit-exact as megatron's import of dist_ckpt/ itself, and as the run's live state."""
    src = os.path.join(_verl_run(tmp_path), entry)
    out, got = _as_direct(tmp_path, src, DIST_CKPT)
    assert len(got) == 17 * 3 + 1 and int(got["opt_state/count"]) == 2
    trees = {"exp_avg": "opt_state/mu", "exp_avg_sq": "opt_state/nu", "param": "params"}
    with np.load(TRUTH) as truth:
        for key in truth.files:  # the live state, padded vocab rows and all (no vocab_size=)
            state, _, param = key[len("optimizer.state.") :].partition(".")
            assert got[f"{trees[state]}/{param}"].tobytes() == truth[key].tobytes(), key
    source = jax_ucp.inspect(out).source
    assert source["framework"] == "megatron" and source["format"] == "torch_dist"
    assert source["path"] == str(tmp_path / "run" / ACTOR / "dist_ckpt")
    assert source["verl"] == {
        "backend": "megatron",
        "path": str(tmp_path / "run" / ACTOR),
        "global_step": 2,
        "tracker_step": 2,
        "model_config": {"vocab_size": 61},
    }


def test_the_cli_converts_the_run_root(tmp_path):
    """``jax-ucp convert <run root>``: once refused as two formats (megatron's tracker,
    deepspeed's global_step*); ``weights_only`` reaches megatron's import."""
    run = _verl_run(tmp_path)
    proc = run_cli("convert", run, str(tmp_path / "ucp"))
    assert proc.returncode == 0, proc.stderr
    assert "formats" not in proc.stderr
    assert jax_ucp.inspect(tmp_path / "ucp").source["verl"]["global_step"] == 2
    weights = jax_ucp.restore(
        jax_ucp.convert(run, tmp_path / "weights", importing=ImportOptions(weights_only=True))
    )
    assert list(weights) == ["params"]  # megatron's weights_only, through verl's options
    full = jax_ucp.restore(tmp_path / "ucp")["params"]
    assert all(weights["params"][k].tobytes() == np.asarray(v).tobytes() for k, v in full.items())


def test_bridge_mode_is_refused_by_name(tmp_path):
    """use_dist_checkpointing=False: dist_ckpt/ holds the optimizer's state and no model tensor
    (synthetic: one optimizer tensor written by the DCP writer beside megatron-core's
    common.pt / metadata.json); the weights are huggingface/'s safetensors."""
    synthetic = tmp_path / "synthetic_bridge_dist_ckpt"
    synthetic.mkdir()
    for name in ("common.pt", "metadata.json"):
        shutil.copy(os.path.join(DIST_CKPT, name), synthetic)
    name = "optimizer.state.exp_avg.output_layer.weight"
    item = DcpItem(name, (name,), (4,), np.dtype(np.float32))
    write_dcp(str(synthetic), [item], [np.zeros(4, np.float32)], "synthetic")
    run = _verl_run(tmp_path, str(synthetic))
    for entry in ("", "global_step_2", ACTOR):
        with pytest.raises(SourceError, match=r"bridge mode .*safetensors in .*actor/huggingface"):
            jax_ucp.convert(os.path.join(run, entry), tmp_path / "refused")
        assert_destination_untouched(tmp_path / "refused")
