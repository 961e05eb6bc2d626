"""verl FSDP checkpoints written by verl 0.9.1's own ``FSDPCheckpointManager``
(tools/fixtures/make_verl_fixture.py: FSDP2 DTensors and FSDP1 ShardedTensors over 2 gloo
ranks, 3 AdamW steps, the trainer's tracker and ``data.pt`` around them), read without torch and
compared with the run's live state."""

from __future__ import annotations

import os
import shutil
import zipfile

import numpy as np
import pytest

import jax_ucp
from jax_ucp._src.importers.registry import IMPORTERS, detect_format
from jax_ucp._src.store.storage import storage_for
from jax_ucp.conversion import ImportOptions
from jax_ucp.errors import SourceError
from tests.importers.torch.test_hf_trainer import assert_matches_run
from tests.ucp_testing import REPO, assert_destination_untouched, load_truth

pytestmark = pytest.mark.timeout(180)
FIX = os.path.join(REPO, "tests", "fixtures", "verl")
STEP = os.path.join("global_step_3")
ACTOR = os.path.join(STEP, "actor")


def _truth(kind: str) -> dict[str, np.ndarray]:
    """The run's live params, moments and step (the continuation's keys left out)."""
    want = load_truth(os.path.join(FIX, f"{kind}.truth.npz"))
    return {k: v for k, v in want.items() if not k.startswith("next_")}


def _copy(tmp_path, kind: str = "fsdp2") -> str:
    return str(shutil.copytree(os.path.join(FIX, kind), tmp_path / kind))


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize("entry", ["", STEP, ACTOR])
def test_every_entry_point_is_detected_as_verl(kind, entry):
    """The run root holds Megatron's tracker name and a DeepSpeed-like global_step_N/: both
    claims are outranked by verl's rank files."""
    path = os.path.join(FIX, kind, entry)
    assert detect_format(path) == "verl"
    if not entry:
        assert IMPORTERS["megatron"].detect(storage_for(path)).found
        assert IMPORTERS["deepspeed"].detect(storage_for(path)).found


@pytest.mark.parametrize("entry", ["", STEP, ACTOR])
def test_fsdp2_run_imports_weights_moments_and_step_bit_exact(tmp_path, entry):
    out = jax_ucp.convert(os.path.join(FIX, "fsdp2", entry), tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), _truth("fsdp2"))
    source = jax_ucp.inspect(out).source
    assert source["framework"] == "verl" and source["fsdp_version"] == 2
    assert source["world_size"] == 2 and source["global_step"] == 3
    assert source["tracker_step"] == 3
    assert source["lr_scheduler"]["last_epoch"] == 3
    assert source["optimizer"]["param_groups"][0]["params"][0] == "model.embed_tokens.weight"
    assert sorted(source["skipped"]) == [
        "../data.pt",
        "extra_state_world_size_2_rank_0.pt",
        "extra_state_world_size_2_rank_1.pt",
    ]
    assert source["trainer"]["model_config"]["num_attention_heads"] == 4


def test_fsdp1_weights_bit_exact_and_its_flat_optimizer_refused(tmp_path):
    """FSDP1 (use_orig_params=False) saves flat-parameter optimizer state that names no
    parameter: refused naming the file, with the weights-only advice, which then imports the
    ShardedTensor weights exactly."""
    with pytest.raises(SourceError, match=r"optim_world_size_2_rank_0\.pt.*weights_only=True"):
        jax_ucp.convert(os.path.join(FIX, "fsdp1"), tmp_path / "u")
    assert_destination_untouched(tmp_path / "u")
    out = jax_ucp.convert(
        os.path.join(FIX, "fsdp1"), tmp_path / "w", importing=ImportOptions(weights_only=True)
    )
    restored = jax_ucp.restore(out)
    want = _truth("fsdp1")
    params = {k.split("/", 1)[1]: v for k, v in want.items() if k.startswith("param/")}
    assert sorted(restored["params"]) == sorted(params) and "opt_state" not in restored
    for name, value in params.items():
        assert np.array_equal(restored["params"][name], value), name
    skipped = jax_ucp.inspect(out).source["skipped"]
    assert "optim_world_size_2_rank_1.pt/state.2.exp_avg_sq" in skipped


def test_optax_from_torch_continues_with_torchs_next_step(tmp_path):
    """AdamW identified from the recorded param_groups; fed the 4th step's gradients, optax's
    update gives torch's parameters after its 4th step (the scheduler's lr 0.004 for it)."""
    import jax
    import jax.numpy as jnp
    import optax

    out = jax_ucp.convert(os.path.join(FIX, "fsdp2"), tmp_path / "ucp")
    with pytest.warns(UserWarning, match="schedule"):
        run = jax_ucp.optax_from_torch(out)
    assert run.step == 3 and run.optimizer == "adamw"
    want = load_truth(os.path.join(FIX, "fsdp2.truth.npz"))
    grads = {k[len("next_grad/") :]: v for k, v in want.items() if k.startswith("next_grad/")}
    params = jax.tree.map(jnp.asarray, run.params)
    updates, _ = run.tx.update(jax.tree.map(jnp.asarray, grads), run.opt_state, params)
    got = optax.apply_updates(params, updates)
    for name in grads:
        np.testing.assert_allclose(
            np.asarray(got[name]), want[f"next_param/{name}"], rtol=0, atol=1e-6, err_msg=name
        )


@pytest.mark.parametrize("kind", ["optim", "model", "extra_state"])
def test_a_missing_rank_file_is_refused_naming_it(tmp_path, kind):
    src = _copy(tmp_path)
    os.remove(os.path.join(src, ACTOR, f"{kind}_world_size_2_rank_1.pt"))
    with pytest.raises(SourceError, match=rf"missing {kind}_world_size_2_rank_1\.pt"):
        jax_ucp.convert(src, tmp_path / "u")
    assert_destination_untouched(tmp_path / "u")


def test_rank_files_of_two_world_sizes_are_refused(tmp_path):
    src = _copy(tmp_path)
    actor = os.path.join(src, ACTOR)
    shutil.copy(
        os.path.join(actor, "model_world_size_2_rank_0.pt"),
        os.path.join(actor, "model_world_size_4_rank_0.pt"),
    )
    with pytest.raises(SourceError, match=r"2 world sizes.*model_world_size_4_rank_0\.pt"):
        jax_ucp.convert(src, tmp_path / "u")


def test_fsdp_config_of_another_world_size_is_refused(tmp_path):
    src = _copy(tmp_path)
    with open(os.path.join(src, ACTOR, "fsdp_config.json"), "w") as f:
        f.write('{"FSDP_version": 2, "world_size": 4}')
    with pytest.raises(SourceError, match=r"fsdp_config\.json: world_size 4.*of 2"):
        jax_ucp.convert(src, tmp_path / "u")


def test_a_stale_tracker_is_refused_naming_the_step_and_what_is_there(tmp_path):
    """Not Megatron's "iter_0000005 does not exist": verl's own folders are named."""
    src = _copy(tmp_path)
    with open(os.path.join(src, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    assert detect_format(src) == "verl"
    with pytest.raises(SourceError, match=r"names step 5 .*global_step_5.*found global_step_3"):
        jax_ucp.convert(src, tmp_path / "u")
    assert_destination_untouched(tmp_path / "u")
    out = jax_ucp.convert(os.path.join(src, STEP), tmp_path / "ok")  # the folder itself imports
    assert jax_ucp.inspect(out).source["tracker_step"] == 5


def test_a_run_without_tracker_names_its_step_folders(tmp_path):
    src = _copy(tmp_path)
    os.remove(os.path.join(src, "latest_checkpointed_iteration.txt"))
    with pytest.raises(SourceError, match=r"no latest_checkpointed_iteration\.txt.*global_step_3"):
        jax_ucp.convert(src, tmp_path / "u")


def test_an_optimizer_other_than_adam_is_refused_naming_its_state(tmp_path):
    """exp_avg_sq renamed in rank 0's pickle (the archive rewritten with zipfile): state
    torch's Adam does not hold is refused, naming the file and the key."""
    src = _copy(tmp_path)
    path = os.path.join(src, ACTOR, "optim_world_size_2_rank_0.pt")
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            if name.endswith("data.pkl"):
                data = data.replace(b"exp_avg_sq", b"exp_avg_sx")
            z.writestr(name, data)
    with pytest.raises(SourceError, match=r"optim_world_size_2_rank_0\.pt.*exp_avg_sx"):
        jax_ucp.convert(src, tmp_path / "u")
    assert_destination_untouched(tmp_path / "u")


def test_the_critic_beside_the_actor_is_listed_and_imports_on_its_own(tmp_path):
    src = _copy(tmp_path)
    shutil.copytree(os.path.join(src, ACTOR), os.path.join(src, STEP, "critic"))
    out = jax_ucp.convert(src, tmp_path / "a", importing=ImportOptions(weights_only=True))
    assert "../critic/" in jax_ucp.inspect(out).source["skipped"]
    out = jax_ucp.convert(os.path.join(src, STEP, "critic"), tmp_path / "c")
    assert_matches_run(jax_ucp.restore(out), _truth("fsdp2"))


def test_tied_embeddings_import_once_trained_and_tied(tmp_path):
    """tie_word_embeddings=True (Qwen2.5's small models): both keys are saved, sharing their
    bytes on each rank; the optimizer holds 20 states for 21 keys. lm_head.weight imports tied to
    the embedding (its bytes), with no moments of its own; the rest bit-exact to the run."""
    out = jax_ucp.convert(os.path.join(FIX, "fsdp2_tied"), tmp_path / "ucp")
    restored = jax_ucp.restore(out)
    want = _truth("fsdp2_tied")
    head = restored["params"].pop("lm_head.weight")
    assert_matches_run(restored, want)
    assert np.array_equal(head, want["param/model.embed_tokens.weight"])
    manifest = jax_ucp.inspect(out)
    assert manifest.source["optimizer"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    entry = next(t for t in manifest.tensors if t.key == ("params", "lm_head.weight"))
    assert entry.tied_to == "params/model.embed_tokens.weight"
    with pytest.warns(UserWarning, match="schedule"):
        run = jax_ucp.optax_from_torch(out)  # one parameter, one state, as torch steps it
    assert "lm_head.weight" not in run.params and len(run.params) == 20


def _with_param_names(path: str, names: list[str]) -> None:
    """Rewrite an optim rank file as torch >= 2.5 saves an optimizer built from
    ``named_parameters()`` (``param_groups[0]["param_names"]``), with torch itself."""
    import torch

    state = torch.load(path, weights_only=False)  # our own fixture, not user input
    state["param_groups"][0]["param_names"] = names
    torch.save(state, path)


@pytest.mark.torch
def test_recorded_param_names_name_the_moments_and_must_be_the_models(tmp_path):
    """The optimizer's own names win over the order: the fixture's (the model's order) import
    bit-exact; a name the model does not hold is refused naming it."""
    src = _copy(tmp_path)
    optim = [os.path.join(src, ACTOR, f"optim_world_size_2_rank_{r}.pt") for r in (0, 1)]
    want = _truth("fsdp2")
    names = [k.split("/", 1)[1] for k in want if k.startswith("param/")]
    for path in optim:
        _with_param_names(path, names)
    out = jax_ucp.convert(src, tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), want)
    for path in optim:
        _with_param_names(path, ["model.no_such.weight", *names[1:]])
    with pytest.raises(SourceError, match=r"optim_world_size_2_rank_0\.pt.*model\.no_such\.weight"):
        jax_ucp.convert(src, tmp_path / "u")


def test_cli_converts_the_run_root_and_refuses_a_missing_rank_naming_it(tmp_path):
    from typer.testing import CliRunner

    from jax_ucp.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["convert", os.path.join(FIX, "fsdp2"), str(tmp_path / "ucp")])
    assert r.exit_code == 0, r.output
    assert jax_ucp.inspect(tmp_path / "ucp").source["framework"] == "verl"
    src = _copy(tmp_path)
    os.remove(os.path.join(src, ACTOR, "model_world_size_2_rank_0.pt"))
    r = runner.invoke(app, ["convert", src, str(tmp_path / "u")])
    assert r.exit_code == 1 and "model_world_size_2_rank_0.pt" in r.output, r.output
    assert_destination_untouched(tmp_path / "u")


def test_rank_files_of_two_saves_are_refused_naming_the_file(tmp_path):
    """rank 1's model file from the FSDP1 run (same keys, ShardedTensors whose pieces would tile
    the tensors just as well): refused naming the rank file and both kinds, never mixed."""
    src = _copy(tmp_path)
    other = os.path.join(FIX, "fsdp1", ACTOR, "model_world_size_2_rank_1.pt")
    shutil.copy(other, os.path.join(src, ACTOR, "model_world_size_2_rank_1.pt"))
    with pytest.raises(
        SourceError, match=r"model_world_size_2_rank_1\.pt.*ShardedTensor.*rank_0\.pt.*DTensor"
    ):
        jax_ucp.convert(src, tmp_path / "u")


def _doubled(path: str, out: str) -> None:
    """A valid copy of the torch zip ``path`` at ``out`` whose float32 storages hold every
    value doubled (members stored, CRCs recomputed): another run's rank file, as a loader sees
    it."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if "/data/" in info.filename and len(data) % 4 == 0 and len(data) > 8:
                data = (np.frombuffer(data, np.float32) * 2).tobytes()
            dst.writestr(info.filename, data)


def test_a_rank_file_numbered_in_other_digits_is_not_read(tmp_path):
    """``model_world_size_2_rank_١.pt`` (Arabic-Indic one) holding doubled values: ``\\d``
    read it as rank 1 and it silently replaced the real rank-1 file; only ASCII digits
    number a rank, so the import is the run's, bit for bit."""
    actor = os.path.join(_copy(tmp_path), ACTOR)
    _doubled(
        os.path.join(actor, "model_world_size_2_rank_1.pt"),
        os.path.join(actor, "model_world_size_2_rank_\u0661.pt"),
    )
    out = jax_ucp.convert(os.path.dirname(os.path.dirname(actor)), tmp_path / "ucp")
    assert_matches_run(jax_ucp.restore(out), _truth("fsdp2"))


def test_two_names_for_one_rank_are_refused_naming_both(tmp_path):
    """``rank_01.pt`` beside ``rank_1.pt``: both are rank 1; one would be read and the other
    left out unsaid."""
    actor = os.path.join(_copy(tmp_path), ACTOR)
    _doubled(
        os.path.join(actor, "model_world_size_2_rank_1.pt"),
        os.path.join(actor, "model_world_size_2_rank_01.pt"),
    )
    with pytest.raises(
        SourceError,
        match=r"'model_world_size_2_rank_01\.pt' and 'model_world_size_2_rank_1\.pt' both name",
    ):
        jax_ucp.convert(actor, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_a_tracker_in_other_digits_is_refused(tmp_path):
    """``int()`` reads ``٣`` as 3: the tracker names a step only in ASCII digits."""
    root = _copy(tmp_path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("\u0663")
    with pytest.raises(SourceError, match=r"latest_checkpointed_iteration\.txt: expected verl"):
        jax_ucp.convert(root, tmp_path / "refused")


def _scheduler_at(actor: str, rank: int, last_epoch: int) -> None:
    """Rank ``rank``'s extra state with its lr scheduler's ``last_epoch`` pickled as another
    number (a valid zip, CRCs recomputed)."""
    path = os.path.join(actor, f"extra_state_world_size_2_rank_{rank}.pt")
    with zipfile.ZipFile(path) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            if name.endswith("/data.pkl"):
                old = b"last_epochq\x05K\x03"
                assert data.count(old) == 1
                data = data.replace(old, b"last_epochq\x05K" + bytes([last_epoch]))
            z.writestr(name, data)


def test_a_scheduler_that_disagrees_with_the_optimizer_step_is_said(tmp_path):
    """Both ranks' schedulers at last_epoch 10, the optimizer at step 3: imported at the
    optimizer's step with a warning and a note naming both (it passed silently)."""
    actor = os.path.join(_copy(tmp_path), ACTOR)
    for rank in (0, 1):
        _scheduler_at(actor, rank, 10)
    with pytest.warns(UserWarning, match=r"last_epoch 10, the optimizer .* step 3"):
        out = jax_ucp.convert(actor, tmp_path / "ucp")
    source = jax_ucp.inspect(out).source
    assert any("last_epoch 10" in n and "step 3" in n for n in source["notes"])
    assert int(jax_ucp.restore(out)["opt_state"]["count"]) == 3


def test_ranks_whose_schedulers_disagree_are_refused_naming_both(tmp_path):
    """Rank 1's scheduler at last_epoch 10, rank 0's at 3: files of two saves; only rank 0's
    was read, so it passed silently."""
    actor = os.path.join(_copy(tmp_path), ACTOR)
    _scheduler_at(actor, 1, 10)
    with pytest.raises(
        SourceError,
        match=r"schedulers disagree on last_epoch: extra_state_world_size_2_rank_0\.pt has "
        r"last_epoch=3, extra_state_world_size_2_rank_1\.pt has last_epoch=10",
    ):
        jax_ucp.convert(actor, tmp_path / "refused")
    assert_destination_untouched(tmp_path / "refused")


def test_a_huggingface_folder_linked_out_of_the_model_folder_is_refused(tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind verl --seed 13
    --index 17``): ``actor/huggingface`` linked to a folder outside the checkpoint had its
    ``config.json`` read (its settings became the import's model config), as only the link of
    ``config.json`` within ``huggingface/`` was checked."""
    src = _copy(tmp_path)
    hf = os.path.join(src, ACTOR, "huggingface")
    outside = shutil.copytree(hf, tmp_path / "elsewhere")
    shutil.rmtree(hf)
    os.symlink(outside, hf)
    with pytest.raises(SourceError, match=r"huggingface/config\.json"):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_actor_folder_linked_out_of_its_step_is_refused_before_a_read(tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind verl --seed 29
    --index 26``): ``global_step_3/actor`` moved out and linked back had every rank file read
    through the link, by convert and a direct restore (only the step folder was checked)."""
    from tests.hostile.spy import watch_opens

    src = _copy(tmp_path)
    actor = os.path.join(src, ACTOR)
    outside = str(tmp_path / "elsewhere")
    shutil.move(actor, outside)
    os.symlink(outside, actor)
    opened = []
    with watch_opens(lambda path, writing: opened.append(os.path.realpath(str(path)))):
        with pytest.raises(jax_ucp.UnsafeFileError, match=r"'actor' resolves to .*outside"):
            jax_ucp.convert(src, str(tmp_path / "out"))
        with pytest.raises(jax_ucp.UnsafeFileError, match=r"'actor' resolves to .*outside"):
            jax_ucp.restore(src)
    assert not [p for p in opened if p.startswith(outside)], opened
    assert not (tmp_path / "out").exists()


def test_a_model_config_holding_nan_is_refused_naming_it(tmp_path):
    """Found by the hostile-input harness (``python3 -m tests.hostile --kind verl --seed 17
    --index 8``): ``"use_cache": NaN`` in ``huggingface/config.json`` reached the manifest, whose
    writer raised a raw ``ValueError`` (JSON cannot hold NaN); a config that is not a JSON
    object, or not JSON, was ignored without a word."""
    src = _copy(tmp_path)
    config = os.path.join(src, ACTOR, "huggingface", "config.json")
    text = open(config).read()
    open(config, "w").write(text.replace("{", '{"use_cache": NaN, ', 1))
    with pytest.raises(SourceError, match=r"huggingface/config\.json: not readable JSON \(NaN"):
        jax_ucp.convert(src, str(tmp_path / "out"))
    open(config, "w").write("[1, 2]")
    with pytest.raises(SourceError, match=r"config\.json: expected a JSON object, found list"):
        jax_ucp.convert(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
