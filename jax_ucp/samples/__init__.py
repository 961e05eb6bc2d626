"""Small real checkpoints shipped with the package, so the docs' examples and the notebooks run
from any directory (a pip install has no tests/ folder).

Each is a copy of a test fixture written by the real framework (torch 2.13, megatron-core 0.16,
DeepSpeed 0.19.8 on CPU; tests/test_samples.py checks the copies stay byte-equal):

- ``megatron_llama_tp2``: a megatron-core ``torch_dist`` checkpoint of a Llama-style GPT
  (TP=2, GQA 4 heads / 2 groups, SwiGLU, RoPE, RMSNorm; hidden 32, 2 layers, vocab 61 padded to
  64) with its distributed-optimizer Adam state. Its model settings: ``settings(name)``; the
  logits megatron-core computed for some tokens: ``reference(name)``.
- ``deepspeed_z2_bf16_dp2``: a DeepSpeed ZeRO-2 bf16 run on 2 ranks (a GPT-2-style model, 2
  steps), the folder holding ``latest``.
- ``hf_trainer_llama``: a Hugging Face Trainer ``checkpoint-3/`` (transformers 5.23, a tiny
  Llama, 3 AdamW steps with the Trainer's decay / no-decay groups, linear warm-up, clipping
  1.0): the weights, ``optimizer.pt``, ``scheduler.pt``, ``training_args.bin``,
  ``trainer_state.json``. ``reference(name)``: the run's next two batches (``tokens``) and
  torch's losses (``losses``) and learning rates (``lrs``) of steps 4 and 5;
  ``settings(name)["parameter_order"]``: the Trainer's parameter order (what transformers
  rebuilds from ``config.json`` when it is installed).

The files are read-only inputs: convert them to a directory of your own.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jax_ucp.errors import RequestError as _RequestError

__all__ = [
    "NAMES",
    "path",
    "reference",
    "settings",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ("megatron_llama_tp2", "deepspeed_z2_bf16_dp2", "hf_trainer_llama")
#: each sample's reference arrays (what the source framework computed), where it ships them
_REFERENCES = {
    "megatron_llama_tp2": "megatron_llama_tp2.logits.npz",
    "hf_trainer_llama": "hf_trainer_llama.next.npz",
}


def _check(name: str) -> None:
    if name not in NAMES:
        raise _RequestError(f"no sample named {name!r} (samples: {', '.join(NAMES)})")


def path(name: str) -> str:
    """The sample checkpoint's directory (pass it to ``jax_ucp.convert``)."""
    _check(name)
    return os.path.join(_HERE, name)


def settings(name: str) -> dict:
    """The settings of the run that wrote the sample (model sizes, parallelism, versions)."""
    _check(name)
    with open(os.path.join(_HERE, f"{name}.json")) as f:
        return json.load(f)


def reference(name: str) -> dict[str, np.ndarray]:
    """What the source framework computed, to check a conversion against: ``tokens`` and the
    ``logits`` of them (megatron_llama_tp2, padded vocab), or the next batches ``tokens`` and
    torch's ``losses`` and ``lrs`` of them (hf_trainer_llama)."""
    _check(name)
    if name not in _REFERENCES:
        raise _RequestError(f"sample {name!r} ships no reference arrays")
    with np.load(os.path.join(_HERE, _REFERENCES[name])) as z:
        return {k: z[k] for k in z.files}
