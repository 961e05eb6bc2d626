"""torchtune's index-keyed optimizers (the single-device full-finetune recipe's
``recipe_state.pt``, the asynchronous ``dist_epoch_N/``) ordered by torchtune's own model builder
when torchtune is installed (before: refused without ``parameter_order=`` whether or not it was).

The torch-free tests stand a recording builder in for torchtune's (it makes the parameters it is
told to: the wiring, and what happens when the builder makes other parameters); the
``torch``-marked ones run torchtune 0.6.1 itself (skipped where it is not installed: it needs
``torchao==0.11.0`` and a venv of its own, see tools/fixtures/make_torchtune_dist_fixtures.py).
"""

from __future__ import annotations

import contextlib
import types

import pytest

import jax_ucp
from jax_ucp._src.importers.torch import torchtune_order
from tests.importers.torch.test_torchtune import (
    ASYNC,
    ORDER,
    SRC,
    TRUTH,
    _assert_the_live_dist_run,
    _assert_the_live_run,
)
from tests.ucp_testing import assert_destination_untouched

pytestmark = pytest.mark.timeout(120)


def _standin(monkeypatch, extra: tuple[str, tuple[int, ...]] | None = None) -> list[dict]:
    """torchtune's builder replaced by one making the run's parameters (in ORDER, with the
    truth's shapes; ``extra``: one more); returns the arguments it was called with."""
    calls: list[dict] = []
    shapes = [(n, TRUTH[f"param/{n}"].shape) for n in ORDER] + ([extra] if extra else [])

    def llama3_2(**sizes):
        calls.append(sizes)
        named = [(n, types.SimpleNamespace(shape=s)) for n, s in shapes]
        return types.SimpleNamespace(named_parameters=lambda: iter(named))

    torch = types.SimpleNamespace(device=lambda _: contextlib.nullcontext())
    torchtune = types.SimpleNamespace(__version__="0.6.1")
    monkeypatch.setattr(torchtune_order, "torchtune_builder", lambda: (torch, torchtune, llama3_2))
    return calls


def test_index_keyed_recipe_state_takes_the_builders_order(tmp_path, monkeypatch):
    """No parameter_order: the builder, called with the sizes the epoch's weights have, gives
    the order; moments land on their parameters bit for bit; the manifest says how."""
    calls = _standin(monkeypatch)
    out = jax_ucp.convert(SRC, tmp_path / "ucp")
    _assert_the_live_run(out)
    (sizes,) = calls
    assert (sizes["vocab_size"], sizes["num_layers"], sizes["embed_dim"]) == (64, 2, 32)
    assert (sizes["intermediate_dim"], sizes["tie_word_embeddings"]) == (48, False)
    source = jax_ucp.inspect(out).source
    assert source["parameter_order"].startswith("torchtune 0.6.1 llama3_2(vocab_size=64")
    assert source["optimizer_keyed_by"] == "index"


def test_dist_epoch_takes_the_builders_order(tmp_path, monkeypatch):
    calls = _standin(monkeypatch)
    out = jax_ucp.convert(ASYNC, tmp_path / "ucp")
    _assert_the_live_dist_run(out)
    assert calls and jax_ucp.inspect(out).source["parameter_order"].startswith("torchtune")


def test_a_builder_making_other_parameters_is_refused_saying_so(tmp_path, monkeypatch):
    """The builder makes a parameter the checkpoint lacks (another architecture): its order is
    not used; refused as without torchtune, saying why."""
    _standin(monkeypatch, extra=("layers.0.attn.q_proj.bias", (32,)))
    with pytest.raises(
        jax_ucp.UCPError,
        match=r"torchtune's builder did not rebuild its order: torchtune's llama3_2 builder "
        r"makes other parameters \(\['layers\.0\.attn\.q_proj\.bias'\]\)",
    ):
        jax_ucp.convert(SRC, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")
    with pytest.raises(jax_ucp.UCPError, match=r"keyed by index"):
        jax_ucp.convert(ASYNC, tmp_path / "out")
    assert_destination_untouched(tmp_path / "out")


@pytest.mark.torch
@pytest.mark.parametrize("src", [SRC, ASYNC], ids=["recipe_state", "dist_epoch"])
def test_torchtunes_own_builder_orders_both_saves(tmp_path, src):
    """torchtune 0.6.1's llama3_2 component builder on the meta device: both index-keyed saves
    import bit-exact against the run's live state without parameter_order."""
    pytest.importorskip("torchtune")
    out = jax_ucp.convert(src, tmp_path / "ucp")
    if src == SRC:
        _assert_the_live_run(out)
    else:
        _assert_the_live_dist_run(out)
    rule = jax_ucp.inspect(out).source["parameter_order"]
    assert rule.startswith("torchtune 0.6.1") and "meta device" in rule
