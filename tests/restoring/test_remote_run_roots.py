"""Run roots of torch trainers in an object store (``s3://`` on the local moto server) and a Hub
repo (``hf://``, the synthetic Hub): a Trainer's output_dir, a DeepSpeed save_dir and a Megatron
save root are listed through their ``Storage`` (no local view built): ``convert`` refuses naming
the run's checkpoints by URL, ``latest_step`` gives the newest complete one, each newer one
passed over said; a prefix of no checkpoint says what it holds."""

from __future__ import annotations

import os
import re
import uuid

import pytest

import jax_ucp
from jax_ucp._src.store.storage import object_store
from tests.importers.deepspeed.test_object_store import assert_same, folder_files, served
from tests.ucp_testing import FIXTURES

pytestmark = pytest.mark.timeout(300)
TRAINER_CKPT = os.path.join(FIXTURES, "hf_trainer", "llama_z2_dp2", "checkpoint-2")
DEEPSPEED = os.path.join(FIXTURES, "deepspeed", "z2_bf16_dp2", "ckpt")
MEGATRON = os.path.join(FIXTURES, "megatron", "legacy_llama_tp2_synthetic")


def _run(folders: dict[str, str], drop: tuple[str, ...] = ()) -> dict[str, bytes]:
    """The files of a run root holding each local folder of ``folders`` under its name ("":
    at the top), but those named in ``drop``."""
    files = {}
    for under, src in folders.items():
        for name, data in folder_files(src).items():
            files["/".join(p for p in (under, name) if p)] = data
    return {name: data for name, data in files.items() if name not in drop}


def _uploaded(monkeypatch, s3_server, files: dict[str, bytes]) -> str:
    """``files`` under a fresh prefix of the moto bucket; its URL. No local view from now on."""
    url = f"{served(monkeypatch, s3_server)}/run-{uuid.uuid4().hex[:8]}"
    for name, data in files.items():
        object_store.write(url, name, data)
    return url


def _refused(url: str, tmp_path, what: str, steps: list[str]) -> None:
    """``convert(url)`` refused as a run root, its checkpoints named, the newest by its URL."""
    message = (
        f"{url}: {what} with {len(steps)} checkpoints: {', '.join(steps)}. Convert one of them "
        f"(e.g. {url}/{steps[-1]})."
    )
    with pytest.raises(jax_ucp.SourceError, match=re.escape(message)):
        jax_ucp.convert(url, str(tmp_path / "ucp"))


def _latest(url: str, step: int, skipped: int, why: str) -> None:
    """``latest_step(url)`` is ``step``, step ``skipped`` passed over naming its URL and why."""
    with pytest.warns(jax_ucp.ResumeWarning) as caught:
        assert jax_ucp.latest_step(url) == step
    texts = [str(w.message) for w in caught]
    assert any(t.startswith(f"{url}: step {skipped} skipped: {url}/") and why in t for t in texts)


def test_a_trainer_output_dir_in_an_object_store(s3_server, monkeypatch, tmp_path):
    files = _run({"checkpoint-2": TRAINER_CKPT, "checkpoint-4": TRAINER_CKPT})
    files["runs/events.out.tfevents"] = b"tensorboard"  # the Trainer's TensorBoard folder
    url = _uploaded(monkeypatch, s3_server, files)
    _refused(
        url, tmp_path, "a Hugging Face Trainer output directory", ["checkpoint-2", "checkpoint-4"]
    )
    object_store.delete(url, "checkpoint-4/trainer_state.json")  # a save that died
    _latest(url, 2, 4, "no trainer_state.json")
    with pytest.warns(jax_ucp.ResumeWarning, match=f"{url}: step 4 skipped"):
        tree = jax_ucp.restore(url)  # the root itself: its latest complete step
    assert_same(tree, jax_ucp.restore(TRAINER_CKPT))


def test_a_trainer_output_dir_in_a_hub_repo(hub_server, monkeypatch, tmp_path):
    """The same run root in a Hub repo: its steps named at the commit listed."""
    served(monkeypatch)
    drop = ("checkpoint-4/trainer_state.json",)
    hub_server.add(
        "org/run", _run({"checkpoint-2": TRAINER_CKPT, "checkpoint-4": TRAINER_CKPT}, drop)
    )
    message = (
        r"hf://org/run: a Hugging Face Trainer output directory with 2 checkpoints: checkpoint-2, "
        r"checkpoint-4\. Convert one of them \(e\.g\. hf://org/run@[0-9a-f]+/checkpoint-4\)\.\Z"
    )
    with pytest.raises(jax_ucp.SourceError, match=message):
        jax_ucp.convert("hf://org/run", str(tmp_path / "ucp"))
    with pytest.warns(jax_ucp.ResumeWarning, match=r"step 4 skipped: hf://org/run@[0-9a-f]+/che"):
        assert jax_ucp.latest_step("hf://org/run") == 2


@pytest.mark.parametrize(
    "src, steps, why",
    [
        (DEEPSPEED, ("global_step2", "global_step5"), "DeepSpeed's `latest`"),
        (MEGATRON, ("iter_0000007", "iter_0000009"), "latest_checkpointed_iteration.txt"),
    ],
    ids=["deepspeed", "megatron"],
)
def test_a_tracked_run_in_an_object_store(s3_server, monkeypatch, src, steps, why):
    """A step newer than the one the run's tracker names did not complete: passed over by
    ``latest_step`` and ``restore(step="latest")``, refused by ``restore(step=N)`` naming its
    URL; the step taken restores as the local one, read in place."""
    files = _run({"": src, steps[1]: os.path.join(src, steps[0])})
    url = _uploaded(monkeypatch, s3_server, files)
    old, new = (int(re.findall("[0-9]+", step)[-1]) for step in steps)
    _latest(url, old, new, why)
    with pytest.raises(jax_ucp.CheckpointError) as e:
        jax_ucp.restore(url, step=new)
    assert str(e.value).startswith(
        f"{url}: step {new} cannot be read: {url}/{steps[1]}: newer than step {old}, which {why} "
    ), str(e.value)
    with pytest.warns(jax_ucp.ResumeWarning, match=f"{url}: step {new} skipped"):
        tree = jax_ucp.restore(url, step="latest")
    assert_same(tree, jax_ucp.restore(os.path.join(src, steps[0])))


def test_a_prefix_of_no_checkpoint_says_what_it_holds(s3_server, monkeypatch, tmp_path):
    url = f"{served(monkeypatch, s3_server)}/notes-{uuid.uuid4().hex[:8]}"
    object_store.write(url, "notes.txt", b"hello")
    object_store.write(url, "plots/loss.png", b"png")
    with pytest.raises(jax_ucp.SourceError) as e:
        jax_ucp.convert(url, str(tmp_path / "ucp"))
    assert str(e.value).startswith(
        f"{url}: cannot tell the checkpoint format; it holds: notes.txt, plots. Tried "
    ), str(e.value)
