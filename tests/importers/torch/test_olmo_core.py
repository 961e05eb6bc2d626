"""An OLMo-core ``save_model_and_optim_state`` checkpoint written by OLMo-core 3.0.0 itself
(tools/fixtures/make_olmo_core_fixture.py): torch DCP whose ``.metadata`` pickles OLMo-core's
own ``_StorageInfo``, read through an inert allow-listed stand-in, imported by auto-detection
with weights, moments and step bit-exact to the run's live state.

OLMo-core's trainer writes that folder as ``stepN/model_and_optim/`` beside ``stepN/train/``
(``rank<R>.pt``, a ``torch.save`` of ``Trainer.state_dict()``) and ``stepN/.metadata.json``
(``Checkpointer.save``): the step folders here are laid out that way around the fixture, the
trainer state written with torch as OLMo-core's ``Trainer.state_dict()`` shapes it."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.registry import detect_format
from tests.importers.torch.test_hf_trainer import assert_matches_run
from tests.torchfiles.test_unpickler import write_pt
from tests.ucp_testing import REPO, assert_convert_refused, load_truth

pytestmark = pytest.mark.timeout(120)
FIX = os.path.join(REPO, "tests", "fixtures", "olmo_core")


def test_olmo_core_checkpoint_imports_bit_exact(tmp_path):
    src = os.path.join(FIX, "olmo_fp32")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), load_truth(os.path.join(FIX, "olmo_fp32.truth.npz")))
    source = jax_ucp.inspect(out).source
    assert source["framework"] == "torch_dcp"
    assert source["optimizer"]["param_groups"][0]["weight_decay"] == 0.1


def test_another_olmo_core_class_in_the_metadata_is_refused(tmp_path):
    """Only OLMo-core's _StorageInfo is allowed: the same pickle naming another class of that
    module (built here by renaming it, same length) is refused by name; nothing is written."""
    src = shutil.copytree(os.path.join(FIX, "olmo_fp32"), tmp_path / "evil")
    meta = os.path.join(src, ".metadata")
    with open(meta, "rb") as f:
        data = f.read()
    assert data.count(b"_StorageInfo") == 1  # the class is named once, then memoized
    with open(meta, "wb") as f:
        f.write(data.replace(b"_StorageInfo", b"_StorageInfX"))
    assert_convert_refused(
        src, tmp_path / "u", r"olmo_core\.distributed\.checkpoint\.filesystem\._StorageInfX"
    )
    assert np.load(os.path.join(FIX, "olmo_fp32.truth.npz"))["step"] == 3


def _step_folder(tmp_path, step: int) -> str:
    """OLMo-core's ``Checkpointer.save`` layout around the fixture, ``train/`` still empty."""
    folder = tmp_path / "run" / f"step{step}"
    shutil.copytree(os.path.join(FIX, "olmo_fp32"), folder / "model_and_optim")
    (folder / "train").mkdir()
    (folder / ".metadata.json").write_text(json.dumps({"version": "3.0.0"}))
    return str(folder)


@pytest.mark.torch
def test_olmo_core_step_folder_imports_bit_exact_with_the_trainer_step(tmp_path):
    """``stepN/`` by auto-detection: the model and optimizer from ``model_and_optim/``, the
    trainer's ``global_step`` from ``train/rank0.pt`` (numpy's and torch's RNG states in it read
    as inert data), every train file listed as skipped."""
    import random

    import torch

    want = load_truth(os.path.join(FIX, "olmo_fp32.truth.npz"))
    step = int(want["step"])
    src = _step_folder(tmp_path, step)
    state = {  # olmo_core.train.Trainer.state_dict()
        "global_step": step,
        "global_train_tokens_seen": 72,
        "max_steps": 10,
        "data_loader": {"dataset_type": "fsl", "batches_processed": step, "seed": 0, "epoch": 1},
        "epoch": 1,
        "world_size": 1,
        "rng": {
            "python": {"version": (3, 11), "state": random.getstate()},
            "numpy": {"version": (2, 1), "state": np.random.get_state()},
            "torch": {"version": (2, 13), "state": torch.random.get_rng_state()},
            "cuda": None,
        },
        "callbacks": {"speed_monitor": {}},
    }
    torch.save(state, os.path.join(src, "train", "rank0.pt"))
    assert detect_format(src) == "torch"
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), want)
    source = jax_ucp.inspect(out).source
    assert source["folders"] == ["model_and_optim"]
    assert source["trainer"]["global_step"] == step
    assert source["trainer"]["olmo_core_version"] == "3.0.0"
    assert "train/rank0.pt" in source["skipped"]
    assert not any("not recovered" in n for n in source.get("notes", []))


def test_olmo_core_step_folder_without_a_step_says_so(tmp_path):
    """A ``train/rank0.pt`` holding no ``global_step``: the weights and optimizer import all the
    same, and the record says the trainer's step was not recovered, and why."""
    src = _step_folder(tmp_path, 3)
    write_pt(os.path.join(src, "train", "rank0.pt"), pickle.dumps({"epoch": 1}, protocol=2))
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), load_truth(os.path.join(FIX, "olmo_fp32.truth.npz")))
    trainer = jax_ucp.inspect(out).source["trainer"]
    assert "global_step" not in trainer
    assert "no 'global_step'" in trainer["global_step_unread"]
    assert "epoch" in trainer["global_step_unread"]
    notes = jax_ucp.inspect(out).source["notes"]
    assert any("trainer step not recovered" in n for n in notes)


def test_olmo_core_step_folder_with_an_empty_train_folder_says_so(tmp_path):
    src = _step_folder(tmp_path, 3)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    trainer = jax_ucp.inspect(out).source["trainer"]
    assert trainer["train_files"] == []
    assert "no train/rank0.pt" in trainer["global_step_unread"]


def test_olmo_core_save_folder_names_its_step_folders(tmp_path):
    """The folder holding ``step1/``, ``step3/``: refused, naming them (as for a Trainer's
    output directory)."""
    _step_folder(tmp_path, 3)
    _step_folder(tmp_path, 1)
    assert_convert_refused(
        tmp_path / "run", tmp_path / "u", r"OLMo-core save folder with 2 checkpoints: step1, step3"
    )


def test_olmo_core_train_state_linked_out_of_the_checkpoint_is_refused(tmp_path):
    """``train/rank0.pt`` is read only inside the checkpoint: a link to a file elsewhere is
    refused naming it; nothing is written."""
    src = _step_folder(tmp_path, 3)
    elsewhere = tmp_path / "private.pt"
    write_pt(elsewhere, pickle.dumps({"global_step": 3}, protocol=2))
    os.symlink(elsewhere, os.path.join(src, "train", "rank0.pt"))
    assert_convert_refused(src, tmp_path / "u", r"train/rank0\.pt")


def test_olmo_core_step_folder_holding_only_model_and_optim_imports(tmp_path):
    """``stepN/`` with ``model_and_optim/`` alone (before: "cannot tell the checkpoint format"):
    read as OLMo-core's layout, weights and optimizer bit-exact, the trainer's step recorded as
    not recovered and why; a save folder of such step folders names them."""
    src = _step_folder(tmp_path, 3)
    shutil.rmtree(os.path.join(src, "train"))
    os.remove(os.path.join(src, ".metadata.json"))
    assert detect_format(src) == "torch"
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), load_truth(os.path.join(FIX, "olmo_fp32.truth.npz")))
    source = jax_ucp.inspect(out).source
    assert source["folders"] == ["model_and_optim"]
    assert source["trainer"]["train_files"] == []
    assert "train/ is missing" in source["trainer"]["global_step_unread"]
    assert any("trainer step not recovered" in n for n in source["notes"])
    assert_convert_refused(
        tmp_path / "run", tmp_path / "u2", r"OLMo-core save folder with 1 checkpoints?: step3"
    )
