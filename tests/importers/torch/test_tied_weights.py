"""A tied ``lm_head.weight`` (one storage with the embedding; torch's optimizer keeps one state,
under the embedding) is recorded as tied to the embedding in the manifest, not as frozen."""

from __future__ import annotations

import json

import msgspec
import pytest

import jax_ucp
from jax_ucp._src import format as fmt
from jax_ucp.conversion import TorchOptions

pytestmark = pytest.mark.timeout(300)


def test_tied_to_round_trips_and_old_manifests_still_read():
    """``tied_to`` is written only when set (manifests without it unchanged, still read), read back
    exactly, and refused when not a string."""
    entry = fmt.TensorEntry(
        key=("params", "lm_head.weight"),
        key_types=("key", "key"),
        dir="arrays/params.lm_head.weight",
        shape=(4, 2),
        dtype="float32",
        chunk_shape=(4, 2),
        inner_chunk_shape=(4, 2),
        compression=None,
        checksum=None,
        role="param",
        tied_to="params/model.embed_tokens.weight",
    )
    d = entry.to_json()
    assert d["tied_to"] == "params/model.embed_tokens.weight" and "frozen" not in d
    assert msgspec.convert(json.loads(json.dumps(d)), fmt.TensorEntry) == entry
    plain = dict(d)
    del plain["tied_to"]
    assert msgspec.convert(plain, fmt.TensorEntry).tied_to is None
    assert "tied_to" not in msgspec.convert(plain, fmt.TensorEntry).to_json()
    with pytest.raises(Exception, match="tied_to"):
        msgspec.convert(dict(d, tied_to=3), fmt.TensorEntry)


@pytest.mark.torch
def test_torch_tied_lm_head_is_tied_not_frozen(tmp_path):
    """torch.save of a model whose lm_head shares the embedding's weight, and its Adam state after
    one step: lm_head.weight imports tied to the embedding (bit-exact to it), no moments of its
    own; an untied parameter without state would still be frozen."""
    import numpy as np
    import torch

    torch.manual_seed(0)
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"embed_tokens": emb, "lm_head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    head(emb(torch.tensor([1, 2, 3]))).sum().backward()
    opt.step()
    (tmp_path / "src").mkdir()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    torch.save(opt.state_dict(), tmp_path / "src" / "optimizer.pt")
    # a folder of pytorch_model.bin + optimizer.pt without config.json: the optimizer's order
    # is given (model.named_parameters(), which lists a tied weight once)
    order = [name for name, _ in model.named_parameters()]
    ckpt = jax_ucp.convert(
        str(tmp_path / "src"), str(tmp_path / "ucp"), importing=TorchOptions(parameter_order=order)
    )
    info = jax_ucp.inspect(ckpt)
    by_name = {fmt.key_to_str(e.key): e for e in info.tensors}
    lm = by_name["params/lm_head.weight"]
    assert lm.tied_to == "params/embed_tokens.weight"
    assert not lm.frozen
    assert not any(e.frozen for e in info.tensors)
    assert "opt_state/mu/lm_head.weight" not in by_name
    assert "opt_state/mu/embed_tokens.weight" in by_name
    got = jax_ucp.restore(ckpt)
    want = emb.weight.detach().numpy()
    assert np.asarray(got["params"]["lm_head.weight"]).tobytes() == want.tobytes()
    assert info.source["optimizer"]["tied"] == {"lm_head.weight": "embed_tokens.weight"}
