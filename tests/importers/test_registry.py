"""The importer registry: one package per source format, each with ``detect`` and ``plan`` and
typed options; detection order, its refusal message, options a format does not take, and the
one ``jax-ucp convert SRC DST [--from FMT]`` (with ``convert FMT SRC DST`` kept)."""

import dataclasses
import importlib
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

import jax_ucp
from jax_ucp._src.importers import registry
from jax_ucp._src.importers.orbax import OrbaxOptions
from jax_ucp._src.importers.plan import Detection, ImportOptions
from jax_ucp._src.store.storage import storage_for
from jax_ucp.cli import app
from jax_ucp.conversion import DeepSpeedOptions, MegatronOptions
from jax_ucp.errors import RequestError, SourceError
from tests.ucp_testing import REPO, assert_bit_exact

FIX = os.path.join(REPO, "tests", "fixtures")
DEEPSPEED = os.path.join(FIX, "deepspeed", "z0_fp32_dp2", "ckpt")
runner = CliRunner()


def _hf(path, value=1.0):
    """A Hugging Face folder with one safetensors file."""
    os.makedirs(path, exist_ok=True)
    save_file({"w": np.full(3, value, np.float32)}, os.path.join(path, "model.safetensors"))
    return str(path)


def test_every_format_is_a_package_with_detect_plan_and_typed_options():
    """One registry level: a format of one layout is its package's ``detect`` / ``plan``; the
    torch format's layouts are each an entry of their own, their functions in its package."""
    assert registry.FORMATS == ("deepspeed", "megatron", "orbax", "safetensors", "torch", "verl")
    for name, importer in registry.IMPORTERS.items():
        package = importlib.import_module(f"jax_ucp._src.importers.{importer.format}")
        if name == importer.format:
            assert importer.detect is package.detect and importer.plan is package.plan
        else:
            assert importer in package.LAYOUTS
            for function in (importer.detect, importer.plan):
                assert function.__module__.startswith(package.__name__ + ".")
        assert dataclasses.is_dataclass(importer.options)
        assert issubclass(importer.options, ImportOptions)
        assert isinstance(importer.detect(storage_for(os.path.join(FIX, "no such dir"))), Detection)
    layouts = [i.name for i in registry.IMPORTERS.values() if i.format == "torch"]
    assert layouts == [
        "torch_checkpointing",
        "torchtune",
        "olmo_core",
        "torch_dcp",
        "hf_trainer",
        "torch_files",
    ]


@pytest.mark.parametrize(
    "path, expected",
    [
        (DEEPSPEED, "deepspeed"),
        (os.path.join(FIX, "megatron", "gpt_tp2"), "megatron"),
        (os.path.join(FIX, "torch", "fsdp2_fp32"), "torch"),
        (os.path.join(FIX, "torch", "accelerate_full"), "torch"),
        # verl's run root holds Megatron's tracker name and DeepSpeed-like global_step_N/
        (os.path.join(FIX, "verl", "fsdp2"), "verl"),
        (os.path.join(FIX, "verl", "fsdp1", "global_step_3", "actor"), "verl"),
    ],
)
def test_real_checkpoints_are_detected_as_their_format(path, expected):
    assert registry.detect_format(path) == expected


def test_own_markers_win_over_files_other_folders_hold_too(tmp_path):
    """safetensors and .bin files in a DeepSpeed folder: DeepSpeed; safetensors beside a
    pytorch_model.bin: safetensors (the first weak claim), as before the registry."""
    ds = tmp_path / "ds"
    shutil.copytree(DEEPSPEED, ds)
    _hf(ds)
    (ds / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
    assert registry.IMPORTERS["safetensors"].detect(storage_for(ds)) == Detection(
        True, "Hugging Face safetensors", weak=True
    )
    assert registry.detect_format(ds) == "deepspeed"
    hf = _hf(tmp_path / "hf")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"PK\x03\x04")
    assert registry.IMPORTERS["torch_files"].detect(storage_for(hf)).found
    assert registry.detect_format(hf) == "safetensors"
    assert registry.detect_format(os.path.join(hf, "model.safetensors")) == "safetensors"


def test_an_unknown_folder_says_what_each_format_looked_for(tmp_path):
    (tmp_path / "weights.npy").write_bytes(b"x")
    with pytest.raises(SourceError) as e:
        registry.detect_format(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path}: cannot tell the checkpoint format; it holds: weights")
    for name, importer in registry.IMPORTERS.items():
        reason = importer.detect(storage_for(tmp_path)).reason
        assert f"{name}: {reason}" in message
    assert "deepspeed: no `latest`, `global_stepN/`" in message
    assert "megatron: no `latest_checkpointed_iteration.txt`" in message
    assert "orbax: no Orbax `_CHECKPOINT_METADATA`" in message
    assert "`--from deepspeed|megatron|orbax|safetensors|torch|verl`" in message
    with pytest.raises(registry.SourceError, match="not a directory"):
        registry.detect_format(tmp_path / "weights.npy")


def test_an_option_the_format_does_not_take_is_refused_before_writing(tmp_path):
    hf = _hf(tmp_path / "hf")
    with pytest.raises(
        RequestError,
        match=r"^vocab_size= applies to megatron checkpoints, not to safetensors ones$",
    ):
        jax_ucp.convert(hf, tmp_path / "a", importing=MegatronOptions(vocab_size=61))
    with pytest.raises(
        RequestError, match=r"^tag= applies to orbax and deepspeed checkpoints, not to torch ones$"
    ):
        jax_ucp.convert(
            hf, tmp_path / "b", format="torch", importing=DeepSpeedOptions(tag="global_step1")
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert OrbaxOptions(tag="3").tag == 3 and OrbaxOptions(tag="last").tag == "last"


def test_cli_convert_detects_or_takes_from(tmp_path, monkeypatch):
    hf = _hf(tmp_path / "hf", 2.0)
    forms = (
        ["{src}", "{dst}"],
        ["{src}", "{dst}", "--from", "safetensors"],
        ["--memory-budget", "1MiB", "{src}", "--force", "{dst}", "--from", "safetensors"],
    )
    for i, form in enumerate(forms):
        dst = str(tmp_path / f"out{i}")
        args = [a.format(src=hf, dst=dst) for a in form]
        r = runner.invoke(app, ["convert", *args], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (args, r.output)
        assert_bit_exact(jax_ucp.restore(dst)["params"]["w"], np.full(3, 2.0, np.float32))
    r = runner.invoke(app, ["convert", hf, str(tmp_path / "y"), "--from", "orbax"])
    assert r.exit_code == 1 and "error:" in r.output and not (tmp_path / "y").exists()
    # the pre-release form `convert FORMAT SRC DST` is gone: three positionals are refused
    r = runner.invoke(app, ["convert", "safetensors", hf, str(tmp_path / "x")])
    assert r.exit_code == 2 and not (tmp_path / "x").exists(), r.output
    # a source folder named like a format, given as SRC DST: a path, not the format
    monkeypatch.chdir(tmp_path)
    _hf(tmp_path / "torch", 3.0)
    r = runner.invoke(app, ["convert", "torch", "z"])
    assert r.exit_code == 0, r.output
    assert_bit_exact(jax_ucp.restore(tmp_path / "z")["params"]["w"], np.full(3, 3.0, np.float32))


def test_cli_convert_help_names_every_format():
    r = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    for name in registry.FORMATS:
        assert name in text
    assert "FORMAT SRC DST" not in text


def test_two_formats_in_one_folder_is_an_error_naming_both(tmp_path):
    """A torch DCP checkpoint and a DeepSpeed checkpoint side by side: importing either would
    silently drop the other, so detection refuses naming both and --from picks one."""
    both = tmp_path / "both"
    shutil.copytree(os.path.join(FIX, "torch", "fsdp2_fp32"), both)
    shutil.copytree(DEEPSPEED, both, dirs_exist_ok=True)
    with pytest.raises(jax_ucp.UCPError, match=r"2 formats: torch .*; deepspeed .*--from"):
        jax_ucp.convert(both, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    jax_ucp.convert(both, tmp_path / "dcp", format="torch")  # --from picks
    assert "dcp_version" in jax_ucp.inspect(tmp_path / "dcp").source


def test_safetensors_beside_a_torch_optimizer_is_handed_to_the_torch_importer():
    """A Trainer ``checkpoint-N/`` (safetensors weights + ``optimizer.pt``) is claimed by the
    safetensors importer; the registry hands it to the torch files importer, which maps the
    optimizer too (the safetensors package never imports the torch one). The safetensors
    importer alone refuses the optimizer; weights_only keeps to the weights."""
    from jax_ucp._src.importers import safetensors
    from jax_ucp._src.importers.torch import TorchOptions
    from jax_ucp.errors import UCPError

    src = os.path.join(FIX, "hf_trainer", "trainer_fp32", "checkpoint-3")
    with np.load(os.path.join(FIX, "hf_trainer", "trainer_fp32.truth.npz")) as z:
        names = [k.split("/", 1)[1] for k in z.files if k.startswith("param/")]
    norms = [n for n in names if n.endswith("norm.weight")]
    order = [n for n in names if n not in norms] + norms  # as the Trainer grouped them
    assert registry.detect_format(src) == "safetensors"
    options = TorchOptions(parameter_order=order)
    claimed, files = registry.IMPORTERS["safetensors"], registry.IMPORTERS["torch_files"]
    taker = registry.taken_over(storage_for(src), claimed, options)
    assert taker is registry.IMPORTERS["hf_trainer"] and taker.takes_over == ("safetensors",)
    handed = taker.plan(storage_for(src), options)
    assert handed is not None and handed.source["framework"] == "torch_files"
    assert handed.source["optimizer"]["param_groups"]
    assert registry.taken_over(storage_for(src), files, options) is files
    assert (
        registry.taken_over(storage_for(src), claimed, TorchOptions(weights_only=True)) is claimed
    )
    with pytest.raises(UCPError, match=r"optimizer\.pt.*weights_only=True"):
        safetensors.plan(storage_for(src), TorchOptions())
    plan = registry.plan_import(src, options)
    assert plan.source == handed.source


def test_takes_over_is_declared_by_the_importer_not_written_in_the_registry(monkeypatch):
    """Any importer may say whose claim it takes over: the registry hands a source over by that
    field alone (no format's internals in the registry), and not when only weights are
    wanted."""
    from jax_ucp._src.importers.plan import Importer, ImportPlan
    from jax_ucp._src.importers.torch import TorchOptions

    seen = []

    def plan(src, options):
        seen.append(options)
        return ImportPlan(iter(()), {"framework": "probe"}, 0, source_tensors=[])

    probe = Importer(
        "probe",
        lambda src: Detection(True, "probe's marker"),
        plan,
        TorchOptions,
        takes_over=("orbax",),
    )
    monkeypatch.setitem(registry.IMPORTERS, "probe", probe)
    src = os.path.join(FIX, "orbax_v1_checkpoint")
    assert registry.detect_format(src) == "orbax"  # a taker claims no source of its own
    options = TorchOptions()
    assert registry.plan_import(src, options, format="orbax").source == {"framework": "probe"}
    assert seen == [options]
    assert registry.taken_over(
        storage_for(src), registry.IMPORTERS["orbax"], TorchOptions(weights_only=True)
    )
    assert registry.taken_over(storage_for(src), registry.IMPORTERS["orbax"], options) is probe


@pytest.mark.parametrize(
    "path, layout",
    [
        (os.path.join(FIX, "torch", "fsdp2_fp32"), "torch_dcp"),
        (os.path.join(FIX, "torch", "accelerate_fsdp"), "torch_dcp"),
        (os.path.join(FIX, "torch", "hf_bin"), "torch_files"),
        (os.path.join(FIX, "torch", "plain_state_dict.pt"), "torch_files"),
        ("olmo", "olmo_core"),
        (os.path.join(FIX, "torchtune", "tt_fp32"), "torchtune"),
        (
            os.path.join(FIX, "torch_checkpointing", "tc_fsdp2_synthetic_layout", "step-3"),
            "torch_checkpointing",
        ),
    ],
)
def test_each_torch_layout_is_its_own_entry_and_torch_names_them_all(path, layout, tmp_path):
    """One registry level: detection finds the torch layout itself (detect_format still says
    "torch"), and ``format="torch"`` means the first torch layout that finds the source, as
    the torch package's dispatch did."""
    if path == "olmo":  # an OLMo-core step folder: torch DCP in model_and_optim/, train/
        path = tmp_path / "step3"
        shutil.copytree(os.path.join(FIX, "olmo_core", "olmo_fp32"), path / "model_and_optim")
        (path / "train").mkdir()
    importer = registry.importer_for(path)
    assert importer.format == "torch" == registry.detect_format(path)
    assert importer.name == layout
    assert registry.importer_for(path, "torch") is importer
    assert registry.importer_for(path, importer.name) is importer


def test_torch_given_for_a_folder_no_torch_layout_finds_is_read_as_torch_save_files(tmp_path):
    """``--from torch`` on a folder none of the torch layouts finds: the torch.save files
    importer plans it and says what is missing (the torch package's last resort before)."""
    assert registry.importer_for(tmp_path, "torch").name == "torch_files"
    with pytest.raises(SourceError, match=str(tmp_path)):
        registry.plan_import(tmp_path, format="torch")
    with pytest.raises(SourceError, match=r"Unknown checkpoint format 'pytorch'.*'torch'"):
        registry.importer_for(tmp_path, "pytorch")


def test_a_layout_given_by_name_is_planned_without_asking_the_others(tmp_path, monkeypatch):
    """``format=`` takes a layout's name too (what the CLI passes once it detected): that
    importer plans, no detection runs."""
    for name, importer in registry.IMPORTERS.items():

        def refuse(src, name=name):
            raise AssertionError(f"{name}.detect asked")

        monkeypatch.setitem(registry.IMPORTERS, name, dataclasses.replace(importer, detect=refuse))
    out = jax_ucp.convert(
        os.path.join(FIX, "torch", "fsdp2_fp32"), tmp_path / "u", format="torch_dcp"
    )
    assert "dcp_version" in jax_ucp.inspect(out).source


def test_no_importer_function_takes_the_common_fields_as_keywords():
    """Every ``plan*`` function of the importers takes the options object (``plan(src,
    options)``, as DeepSpeed's): none takes ``spec=``, ``weights_only=``, ``share=`` or another
    option's field as a parameter of its own."""
    import inspect
    import pkgutil

    from jax_ucp._src import importers

    fields = {f.name for i in registry.IMPORTERS.values() for f in dataclasses.fields(i.options)}
    offenders = []
    for info in pkgutil.walk_packages(importers.__path__, importers.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ != module.__name__ or not name.lstrip("_").startswith("plan"):
                continue
            if function is registry.plan_import:  # the registry's entry: share is its own
                continue
            taken = fields & set(inspect.signature(function).parameters)
            if taken:
                offenders.append(f"{module.__name__}.{name}({', '.join(sorted(taken))})")
    assert offenders == []


def test_torch_given_for_megatron_core_torch_dist_reads_it_as_plain_dcp():
    """Detection leaves a torch_dist folder (DCP beside megatron-core's common.pt and
    metadata.json) to Megatron; ``--from torch`` reads it as plain torch DCP, as the torch
    package's own dispatch did (its ``dcp_dirs``)."""
    src = os.path.join(FIX, "megatron", "gpt_tp2")
    assert registry.detect_format(src) == "megatron"
    assert not registry.IMPORTERS["torch_dcp"].detect(storage_for(src)).found
    assert registry.importer_for(src, "torch").name == "torch_dcp"
    plan = registry.plan_import(src, format="torch")
    assert plan.source["framework"] == "torch_dcp" and plan.total_params == 17
