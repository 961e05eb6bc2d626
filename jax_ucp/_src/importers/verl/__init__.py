"""Import verl FSDP checkpoints (verl 0.9's ``FSDPCheckpointManager``, FSDP1 and FSDP2).

Each rank's ``model_world_size_W_rank_R.pt`` is ``model.state_dict()`` saved with
``torch.save``: DTensors (FSDP2, ``Shard(0)``) or ShardedTensors (FSDP1 under
``SHARDED_STATE_DICT``), read through the allow-listed unpickler with the sharded-tensor
stand-ins and reassembled from every rank's local piece, one tensor at a time
(:mod:`jax_ucp._src.torchfiles.sharded`). ``optim_world_size_W_rank_R.pt`` is
``optimizer.state_dict()``: under FSDP2 its ``exp_avg`` / ``exp_avg_sq`` are DTensors keyed by
parameter index, in the order of the model's parameters (a tied key, sharing its bytes with
an earlier one, counted once, as ``named_parameters()`` does; checked against every shape); under
FSDP1 (``use_orig_params=False``, verl's default) it holds flat-parameter state that names no
parameter, and is refused unless only the weights are wanted. The step is the optimizer's
(every rank and parameter agreeing), beside the run's ``global_step`` (folder and tracker) and
the scheduler's record from ``extra_state_world_size_W_rank_0.pt``.

Output tree (docs/FORMAT.md 2.6): ``params/<name>``, ``opt_state/mu|nu/<name>``,
``opt_state/count``; names are the model's (``model.layers.0.self_attn.q_proj.weight``).

Modules: ``layout`` (where the rank files are), ``rank_tensors`` (the model's tensors across them),
``optimizer`` (its state), ``side_files`` (what verl saves beside), ``planning`` (the options,
``detect`` and ``plan``).
"""

from __future__ import annotations

from jax_ucp._src.importers.verl.planning import VerlOptions, detect, megatron_backend, plan

__all__ = ["VerlOptions", "detect", "megatron_backend", "plan"]
