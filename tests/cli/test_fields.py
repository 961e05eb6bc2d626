"""The command-line options built from the options dataclasses (``jax_ucp._src.cli.fields``):
each is a real field of its class, with its default and its doc, so a renamed or redocumented
field changes the flag with it."""

import dataclasses
import importlib

import pytest
import typer.main

from jax_ucp._src.cli import commands, fields
from jax_ucp.cli import app

BUILT = {
    "convert": commands.IMPORT_FIELDS + commands.CONVERT_FIELDS,
    "export": commands.EXPORT_FIELDS,
    "plan": commands.PLAN_FIELDS,
}


def _class(owner: str):
    module, _, name = owner.rpartition(".")
    return getattr(importlib.import_module(f"jax_ucp._src.{module}"), name)


@pytest.mark.parametrize("command", sorted(BUILT))
def test_each_built_option_is_its_fields(command):
    params = {p.name: p for p in typer.main.get_command(app).commands[command].params}
    for built in BUILT[command]:
        cls = _class(built.owner)
        (field,) = [f for f in dataclasses.fields(cls) if f.name == built.name]
        option = params[built.name]
        if isinstance(field.default, bool):
            assert option.default is field.default, built
        else:
            assert option.default is None, built  # not given: the dataclass's default
        doc = fields.field_doc(cls.__doc__ or "", built.name)
        assert option.help == built.prefix + (built.help or doc), built
        assert doc and doc.split()[0] in (cls.__doc__ or ""), built


def test_a_field_missing_from_its_class_is_an_error_naming_it():
    with pytest.raises(LookupError, match="ConvertOptions has no field forced"):
        fields.FromField("conversion.ConvertOptions", "forced").parameter()
    with pytest.raises(LookupError, match="TaggedOptions has no field spec"):
        fields.FromField("importers.plan.TaggedOptions", "spec").parameter()  # ImportOptions'
