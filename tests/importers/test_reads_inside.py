"""Every file an import reads from a source checkpoint went through the one rule for names
(``format.files.inside`` and its two forms): trackers, metadata, side files and rank files
alike. Files are seen where they are opened (``os.open``, ``open``), whoever opens them."""

from __future__ import annotations

import os
import shutil

import pytest

import jax_ucp
from jax_ucp._src.format import files
from jax_ucp.conversion import TorchOptions
from tests.hostile.spy import watch_opens
from tests.ucp_testing import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")

SOURCES = [
    "deepspeed/z2_bf16_dp2/ckpt",  # latest + ZeRO-2 rank files
    "deepspeed/z3_bf16_dp2/universal",  # latest_universal + zero/<param>/*.pt
    "deepspeed/pipe_pp2_z1_bf16/ckpt",  # pipeline layer files
    "megatron/legacy_gpt_distopt_pp2dp2_synthetic",  # tracker + model_optim_rng + distrib_optim
    "megatron/gpt_tp2",  # torch_dist: .metadata, metadata.json, common.pt, .distcp
    "megatron_bridge/llama_tp1dp2",  # tracker, run_config.yaml, train_state.pt
    "torch/fsdp2_fp32",  # torch DCP
    "torch/accelerate_full",  # model.safetensors + optimizer.bin + Accelerate's records
    "hf_trainer/trainer_fp32/checkpoint-3",  # Trainer side files
    OLMO_STEP := "olmo_core/olmo_fp32 as step3/",  # model_and_optim/, train/, .metadata.json
]


def _copy_source(source: str, src) -> None:
    """The fixture at ``src``; OLMo-core's step folder laid out around its DCP fixture."""
    if source != OLMO_STEP:
        shutil.copytree(os.path.join(FIXTURES, source), src)
        return
    import pickle

    from tests.torchfiles.test_pickle_format import write_pt

    shutil.copytree(os.path.join(FIXTURES, "olmo_core", "olmo_fp32"), src / "model_and_optim")
    (src / "train").mkdir()
    write_pt(src / "train" / "rank0.pt", pickle.dumps({"global_step": 3}, protocol=2))
    (src / ".metadata.json").write_text('{"version": "3.0.0"}')


def _options(source: str) -> dict:
    """A Trainer checkpoint's optimizer order given as the Trainer built it (decayed, then the
    norms), so the import needs no transformers (the default test run has none)."""
    if not source.startswith("hf_trainer/"):
        return {}
    import numpy as np

    kind = source.split("/")[1]
    with np.load(os.path.join(FIXTURES, "hf_trainer", f"{kind}.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    return {"importing": TorchOptions(parameter_order=[n for n in names if n not in norms] + norms)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", SOURCES)
def test_every_file_an_import_reads_went_through_inside(tmp_path, monkeypatch, source):
    src = tmp_path / "src"
    _copy_source(source, src)
    root = os.path.realpath(src)
    checked: set[str] = set()
    for name in ("inside", "inside_checkpoint", "in_own_folder"):
        real = getattr(files, name)

        def wrapped(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            checked.add(os.path.realpath(out))
            return out

        monkeypatch.setattr(files, name, wrapped)
    opened: list[str] = []

    def note(path, writing: bool) -> None:
        if isinstance(path, int) or writing:
            return
        real = os.path.realpath(os.fsdecode(path))
        if real.startswith(root + os.sep) and os.path.isfile(real):
            opened.append(real)

    with watch_opens(note):  # the spy the hostile-input harness runs its children under
        jax_ucp.convert(str(src), str(tmp_path / "out"), **_options(source))
    assert opened, "no source file seen opened: the spy missed the reads"
    unchecked = sorted({os.path.relpath(p, root) for p in opened if p not in checked})
    assert not unchecked, f"read without files.inside: {unchecked}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "source, tracker",
    [
        ("deepspeed/z2_bf16_dp2/ckpt", "latest"),
        ("megatron/legacy_llama_tp2_synthetic", "latest_checkpointed_iteration.txt"),
    ],
)
def test_a_tracker_linked_out_of_the_checkpoint_is_refused(tmp_path, source, tracker):
    """A tracker file that is a symlink to a file elsewhere (naming the same tag) is refused
    naming it, never read."""
    src = tmp_path / "src"
    shutil.copytree(os.path.join(FIXTURES, source), src)
    elsewhere = tmp_path / "elsewhere.txt"
    shutil.copy(src / tracker, elsewhere)
    (src / tracker).unlink()
    (src / tracker).symlink_to(elsewhere)
    with pytest.raises(jax_ucp.UCPError, match="outside the checkpoint") as e:
        jax_ucp.convert(str(src), str(tmp_path / "out"))
    assert tracker in str(e.value)
    assert not (tmp_path / "out").exists()
