"""Each option defined once (jax_ucp/_src/options.py): restore / plan / UCPRestore take
RestoreOptions' fields, convert ConvertOptions' and the format's import options (built at the
edge, handed down whole); one memory knob, ``memory_budget``."""

import dataclasses
import inspect
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import jax_ucp
from jax_ucp import conversion
from jax_ucp._src import store, writer
from jax_ucp._src.format.sizes import DEFAULT_MEMORY_BUDGET
from jax_ucp._src.importers import registry
from jax_ucp._src.importers.deepspeed import DeepSpeedOptions
from jax_ucp._src.importers.megatron import MegatronOptions
from jax_ucp._src.importers.orbax import OrbaxOptions
from jax_ucp._src.importers.plan import ImportOptions, TaggedOptions
from jax_ucp._src.restoring.options import RestoreOptions
from jax_ucp._src.restoring.plan import abstract_mesh
from jax_ucp.cli import app

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP2 = os.path.join(REPO, "tests", "fixtures", "torch", "fsdp2_fp32")
runner = CliRunner()


def _ckpt(tmp_path):
    tree = {f"t{i}": np.full(256, i, np.float32) for i in range(4)}  # 1 KiB each
    return jax_ucp.save(tmp_path / "c", tree), tree


def _budgets(monkeypatch) -> list[int]:
    """The budget of every read window opened from now on."""
    seen: list[int] = []
    real = store.InFlightBytes.__init__

    def init(self, max_bytes, *args, **kwargs):
        seen.append(max_bytes)
        real(self, max_bytes, *args, **kwargs)

    monkeypatch.setattr(store.InFlightBytes, "__init__", init)
    return seen


def test_the_signatures_are_the_dataclasses_fields():
    fields = [f.name for f in dataclasses.fields(RestoreOptions)]
    assert list(inspect.signature(jax_ucp.restore).parameters) == ["path", *fields]
    assert list(inspect.signature(jax_ucp.UCPRestore).parameters) == fields
    assert list(inspect.signature(jax_ucp.plan).parameters) == ["path", *fields, "processes"]
    convert_fields = [f.name for f in dataclasses.fields(conversion.ConvertOptions)]
    assert list(inspect.signature(jax_ucp.convert).parameters) == [
        "source",
        "dest",
        *convert_fields,
    ]
    default = inspect.signature(jax_ucp.restore).parameters["casting"].default
    assert default == "same_kind" and issubclass(jax_ucp.UCPRestore, RestoreOptions)


def test_save_takes_its_dataclass_fields(tmp_path):
    """``save``'s arguments are ``SaveOptions``' fields (``SaveArgs``, ``UCPSave``'s, and
    ``force``): ``compression_level`` too, checked and named as ``save(compression_level=)``."""
    from jax_ucp._src.saving.options import SaveArgs, SaveOptions

    fields = [f.name for f in dataclasses.fields(SaveOptions)]
    assert list(inspect.signature(jax_ucp.save).parameters) == ["path", *fields]
    assert fields == [f.name for f in dataclasses.fields(SaveArgs)] + ["force"]
    assert list(inspect.signature(jax_ucp.UCPSave).parameters) == fields[:-1]
    tree = {"w": np.arange(8, dtype=np.float32)}
    with pytest.raises(jax_ucp.RequestError, match=r"^save\(compression_level=\):.*99"):
        jax_ucp.save(tmp_path / "c", tree, compression="zstd", compression_level=99)
    assert not os.path.exists(tmp_path / "c")
    path = jax_ucp.save(tmp_path / "c", tree, compression="zstd", compression_level=1)
    np.testing.assert_array_equal(jax_ucp.restore(path)["w"], tree["w"])
    with pytest.raises(FileExistsError, match="force=True"):
        jax_ucp.save(path, tree)
    assert jax_ucp.save(path, tree, force=True) == path


def test_restore_takes_the_target_second_and_memory_budget_as_a_size(tmp_path, monkeypatch):
    path, tree = _ckpt(tmp_path)
    budgets = _budgets(monkeypatch)
    target = {k: np.zeros(256, np.float32) for k in tree}
    back = jax_ucp.restore(path, target, memory_budget="2KiB")
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in tree.items()}
    assert 2048 in budgets
    with pytest.raises(TypeError):
        jax_ucp.restore(path, target, None)  # only the target is positional


@pytest.mark.parametrize(
    "call",
    [
        lambda p: jax_ucp.restore(p, max_read_bytes=2),
        lambda p: jax_ucp.verify(p, max_read_bytes=2),
        lambda p: jax_ucp.UCPRestore(max_read_bytes=2),
        lambda p: RestoreOptions(max_read_bytes=2),
    ],
    ids=["restore", "verify", "UCPRestore", "RestoreOptions"],
)
def test_the_pre_release_name_max_read_bytes_is_gone(tmp_path, call):
    with pytest.raises(TypeError, match="max_read_bytes"):
        call(tmp_path / "absent")  # refused before the path is looked at


def test_dataclasses_replace_keeps_the_options_class():
    args = dataclasses.replace(jax_ucp.UCPRestore(memory_budget="1KiB"), casting="safe")
    assert (args.memory_budget, args.casting, type(args)) == (1024, "safe", jax_ucp.UCPRestore)


def test_one_default_for_restore_verify_and_the_writers(tmp_path, monkeypatch):
    path, _ = _ckpt(tmp_path)
    budgets = _budgets(monkeypatch)
    assert jax_ucp.verify(path) == []
    assert RestoreOptions().read_budget == DEFAULT_MEMORY_BUDGET == writer.memory_budget()
    assert budgets[0] == DEFAULT_MEMORY_BUDGET  # verify's window (then one per tensor read)


def test_plan_takes_restores_keywords_and_refuses_what_it_does_not_plan(tmp_path):
    path, _ = _ckpt(tmp_path)
    mesh = abstract_mesh([("data", 2)])
    plan = jax_ucp.plan(path, mesh=mesh, processes=2, memory_budget="1GiB")
    assert [t.name for t in plan.tensors] == ["t0", "t1", "t2", "t3"]
    assert len(plan.process_read_bytes) == 2
    with pytest.raises(jax_ucp.RequestError, match=r"^plan\(dtype=\): not planned yet"):
        jax_ucp.plan(path, mesh=mesh, dtype=np.float16)
    with pytest.raises(jax_ucp.RequestError, match=r"^plan\(casting=\): expected one of"):
        jax_ucp.plan(path, mesh=mesh, casting="lossless")


def test_convert_takes_its_options_keywords_only(tmp_path):
    with pytest.raises(TypeError):
        jax_ucp.convert(FSDP2, tmp_path / "u", "torch")  # type: ignore[misc]
    with pytest.raises(TypeError, match="bogus"):
        jax_ucp.convert(FSDP2, tmp_path / "u", bogus=1)  # type: ignore[call-arg]
    assert not (tmp_path / "u").exists()


def test_the_cli_takes_memory_budget_for_verify_and_convert(tmp_path, monkeypatch):
    path, _ = _ckpt(tmp_path)
    budgets = _budgets(monkeypatch)
    r = runner.invoke(app, ["verify", path, "--memory-budget", "1G"])
    assert r.exit_code == 0, r.output
    assert budgets[0] == 1 << 30  # verify's window (then one per tensor read)
    seen = []
    real = writer.memory_budget_scope

    def scope(nbytes):
        seen.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(writer, "memory_budget_scope", scope)
    r = runner.invoke(app, ["convert", FSDP2, str(tmp_path / "u"), "--memory-budget", "1G"])
    assert r.exit_code == 0, r.output
    assert seen == [1 << 30]
    assert jax_ucp.verify(tmp_path / "u") == []


def test_the_import_options_built_at_the_edge_reach_the_format_unchanged(tmp_path, monkeypatch):
    """``convert(importing=TorchOptions(...))`` hands that very object to the torch DCP
    importer's ``plan``; a general class given (``ImportOptions``, ``TaggedOptions``) is
    specialised to the format the files show (``TaggedOptions`` → ``OrbaxOptions`` for an Orbax
    source); the import fields are no keywords of ``convert``."""
    from jax_ucp._src.importers.torch import TorchOptions

    seen = []
    importer = registry.IMPORTERS["torch_dcp"]

    def plan(src, options):
        seen.append(options)
        return importer.plan(src, options)

    monkeypatch.setitem(registry.IMPORTERS, "torch_dcp", dataclasses.replace(importer, plan=plan))
    options = TorchOptions(weights_only=True)
    jax_ucp.convert(FSDP2, tmp_path / "u", importing=options)
    assert seen[0] is options
    jax_ucp.convert(FSDP2, tmp_path / "k", importing=ImportOptions(weights_only=True))
    assert type(seen[1]) is TorchOptions and seen[1].weights_only
    assert type(registry.importer_options(registry.IMPORTERS["deepspeed"], tag="3")) is (
        DeepSpeedOptions
    )
    general = ImportOptions(spec=None, weights_only=True)
    assert type(registry.for_format(registry.IMPORTERS["megatron"], general)) is MegatronOptions
    orbax = registry.for_format(registry.IMPORTERS["orbax"], TaggedOptions(tag="3"))
    assert (type(orbax), orbax.tag) == (OrbaxOptions, 3)
    with pytest.raises(jax_ucp.RequestError, match=r"^vocab_size=.*megatron.*orbax"):
        registry.importer_options(registry.IMPORTERS["orbax"], tag="3", vocab_size=3)
    with pytest.raises(TypeError, match=r"weights_only"):  # one way in: importing=
        jax_ucp.convert(FSDP2, tmp_path / "v", weights_only=True)  # type: ignore[call-arg]
    assert not (tmp_path / "v").exists()


# Where an option is a field of several dataclasses, and why. A name not listed here that two
# option dataclasses define fails the test below: define it once and pass its object down.
SHARED = {
    # the same knob of different operations, each its own option (restore / export / convert /
    # save)
    "memory_budget": "restore's, export's, convert's and save's own; UCPStreamSave carries "
    "convert's into Orbax's thread",
    "progress": "export's and convert's own callbacks",
    "force": "save's, convert's and the exports' own (replace the destination)",
    "spec": "what import, restore and export each apply (rules, views)",
    "step": "the step convert writes, the step restore reads",
    "dtype": "restore's and the tensor exports' own cast",
    "casting": "restore's and the tensor exports' own casting rule",
    "select": "restore's and the tensor exports' own selection",
    # a direct restore reads a source as convert imports it (restoring.sources.import_source)
    "importing": "the import options of convert and of a restore straight from a source",
    "format": "the source format convert and a restore straight from a source read",
    # forwarded layout options: the save args (saving.options.SaveArgs, UCPSave's base) and
    # UCPStreamSave re-list the writer's ArrayOptions, which the engine builds from them
    "compression": "SaveArgs / UCPStreamSave / convert re-list writer.layout.ArrayOptions'",
    "compression_level": "SaveArgs re-lists ArrayOptions'",
    "checksum": "SaveArgs re-lists ArrayOptions'",
    "inner_chunk_bytes": "SaveArgs / UCPStreamSave re-list ArrayOptions'",
    "source": "SaveArgs' and UCPStreamSave's provenance (the two save args)",
    "param_groups": "the DeepSpeed universal and torch DCP exports' own (the loading optimizer's)",
    "run_record": "the Megatron and torch DCP exports' own (the continued run's record)",
}

OPTION_MODULES = [
    "options.py",
    "conversion.py",
    "restoring/options.py",
    "restoring/plan.py",
    "writer/layout.py",
    "orbax/handler.py",
    "importers/**/*.py",
    "exporters/**/*.py",
    "saving/**/*.py",
]


def _option_fields() -> dict[str, list[str]]:
    """Each option name -> the option dataclasses whose bodies define it (inherited fields are
    the base's): classes named ``*Options`` / ``*Export`` / ``SaveArgs`` or deriving Orbax's
    CheckpointArgs."""
    import ast
    import glob

    found: dict[str, list[str]] = {}
    for pattern in OPTION_MODULES:
        for path in sorted(
            glob.glob(os.path.join(REPO, "jax_ucp", "_src", pattern), recursive=True)
        ):
            with open(path) as f:
                tree = ast.parse(f.read())
            for cls in ast.walk(tree):
                if not isinstance(cls, ast.ClassDef) or not any(
                    "dataclass" in ast.unparse(d) for d in cls.decorator_list
                ):
                    continue
                bases = " ".join(ast.unparse(b) for b in cls.bases)
                named = cls.name.endswith(("Options", "Export", "SaveArgs"))
                if not named and "CheckpointArgs" not in bases:
                    continue
                for node in cls.body:
                    annotation = (
                        ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign) else ""
                    )
                    if (
                        isinstance(node, ast.AnnAssign)
                        and isinstance(node.target, ast.Name)
                        and "ClassVar" not in annotation
                        and "KW_ONLY" not in annotation
                    ):
                        found.setdefault(node.target.id, []).append(cls.name)
    return found


def test_each_option_name_is_a_field_of_exactly_one_dataclass():
    fields = _option_fields()
    assert {"tag", "vocab_size", "parameter_order", "importing", "weights_only"} <= set(fields)
    shared = {name: owners for name, owners in fields.items() if len(owners) > 1}
    assert sorted(shared) == sorted(SHARED), shared


def test_an_import_option_given_flat_to_convert_says_where_it_goes(tmp_path):
    """``convert(src, dst, weights_only=True)`` (the flattened keywords of earlier releases) is
    refused before anything is read, naming the keyword and ``importing=``."""
    with pytest.raises(TypeError, match=r"convert\(\).*\['weights_only'\].*importing="):
        jax_ucp.convert(tmp_path / "nowhere", tmp_path / "out", weights_only=True)
    with pytest.raises(TypeError, match=r"save\(\).*\['bogus'\]\Z"):
        jax_ucp.save(tmp_path / "c", {"x": 1}, bogus=1)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "c")
