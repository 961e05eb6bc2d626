"""Which torch optimizer wrote a parameter group, from the keys only it writes, and the settings
of those continued besides Adam/AdamW: torch's SGD (momentum, Nesterov, coupled decay), torch's
Muon (beside the AdamW of its run's other parameters) and transformers' Adafactor. Their state
is filled from the imported ``opt_state`` by the names optax gives it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jax_ucp._src.continuation.recipe import agreed
from jax_ucp._src.errors import RequestError

__all__ = ["NAMES", "core", "filled_state", "kind_of"]

#: the keys by which each optimizer's groups are known (all of them written by it)
_KEYS = {
    "sgd": frozenset({"momentum", "dampening", "nesterov"}),
    "muon": frozenset({"ns_coefficients", "ns_steps", "momentum", "nesterov", "adjust_lr_fn"}),
    "adafactor": frozenset(
        {"relative_step", "scale_parameter", "warmup_init", "clip_threshold", "decay_rate", "beta1"}
    ),
}
#: how each is named in notes and errors
NAMES = {
    "adam": "torch Adam/AdamW",
    "sgd": "torch SGD",
    "muon": "torch Muon",
    "adafactor": "transformers' Adafactor",
    "lion": "DeepSpeed Lion",
}
#: optax state field -> the torch state it holds (``opt_state/<that>/<param>`` once imported)
_STATE_OF = {
    "trace": "trace",
    "momentum": "trace",
    "mu": "mu",
    "nu": "nu",
    "row": "exp_avg_sq_row",
    "col": "exp_avg_sq_col",
    "sq": "nu",  # exp_avg_sq, imported as Adam's
    "avg": "mu",  # exp_avg
}


def kind_of(group: dict) -> str:
    """ "sgd", "muon", "adafactor", or "adam" for every other group (Adam's own check then
    continues it or refuses it naming what it looks like)."""
    return next((kind for kind, keys in _KEYS.items() if keys <= set(group)), "adam")


def _number(groups: list[dict], key: str, where: str, top: float = math.inf) -> float:
    value = agreed(groups, key, where)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not 0 <= value < top:
        raise RequestError(
            f"{where}: param_groups' {key} = {value!r}: expected a number in [0, {top})"
        )
    return float(value)


def _flag(groups: list[dict], key: str, where: str) -> bool:
    value = agreed(groups, key, where)
    if not isinstance(value, bool):
        raise RequestError(f"{where}: param_groups' {key} = {value!r}: expected True or False")
    return value


def _refuse_set(groups: list[dict], kind: str, where: str, *flags: str) -> None:
    for i, g in enumerate(groups):
        on = next((f for f in flags if g.get(f)), None)
        if on is not None:
            raise RequestError(
                f"{where}: param_groups[{i}]: {NAMES[kind]} with {on}={g[on]!r} is not translated"
            )


def core(kind: str, groups: list[dict], lr: Any, where: str) -> tuple[Any, list[str]]:
    """The optax transformation of ``kind``'s own update (SGD's without learning rate and
    coupled decay, which the caller chains; Muon's and Adafactor's whole), and its notes.

    Args:
        kind: "sgd", "muon" or "adafactor".
        groups: that optimizer's groups.
        lr: SGD's and Muon's learning rate (a number), unused by Adafactor.
        where: the checkpoint, for errors."""
    import optax

    from jax_ucp._src.continuation import transforms

    if kind == "sgd":
        _refuse_set(groups, kind, where, "maximize", "dampening")
        momentum = _number(groups, "momentum", where)
        nesterov = _flag(groups, "nesterov", where)
        said = f"momentum {momentum}{', Nesterov' if nesterov else ''}"
        if not momentum:
            return optax.identity(), ["torch SGD without momentum"]
        return optax.trace(decay=momentum, nesterov=nesterov), [f"torch SGD: {said}"]
    if kind == "muon":
        coefficients = agreed(groups, "ns_coefficients", where)
        fn = agreed(groups, "adjust_lr_fn", where)
        if not (isinstance(coefficients, list | tuple) and len(coefficients) == 3) or fn not in (
            None,
            "original",
            "match_rms_adamw",
        ):
            raise RequestError(
                f"{where}: torch Muon's ns_coefficients {coefficients!r} / adjust_lr_fn {fn!r}: "
                f"expected three numbers and None, 'original' or 'match_rms_adamw'"
            )
        steps = agreed(groups, "ns_steps", where)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise RequestError(f"{where}: torch Muon's ns_steps = {steps!r}")
        settings: dict[str, Any] = dict(
            momentum=_number(groups, "momentum", where),
            nesterov=_flag(groups, "nesterov", where),
            weight_decay=_number(groups, "weight_decay", where),
            ns_coefficients=tuple(float(c) for c in coefficients),
            ns_steps=steps,
            eps=_number(groups, "eps", where, top=1.0),  # 1 or more: no run's
            adjust_lr_fn=fn,
        )
        said = ", ".join(f"{k} {v}" for k, v in settings.items())
        return transforms.torch_muon(lr, **settings), [
            f"torch Muon (bfloat16 Newton-Schulz): {said}"
        ]
    eps = agreed(groups, "eps", where)
    if not (isinstance(eps, list | tuple) and len(eps) == 2):
        raise RequestError(f"{where}: Adafactor's eps = {eps!r}: expected two numbers")
    decay_rate = agreed(groups, "decay_rate", where)
    beta1 = agreed(groups, "beta1", where)
    settings: dict[str, Any] = dict(
        lr=None if agreed(groups, "lr", where) is None else _number(groups, "lr", where),
        eps=(float(eps[0]), float(eps[1])),
        clip_threshold=_number(groups, "clip_threshold", where),
        decay_rate=float(decay_rate) if isinstance(decay_rate, int | float) else math.nan,
        beta1=None if beta1 is None else _number(groups, "beta1", where, top=1.0),
        weight_decay=_number(groups, "weight_decay", where),
        scale_parameter=_flag(groups, "scale_parameter", where),
        relative_step=_flag(groups, "relative_step", where),
        warmup_init=_flag(groups, "warmup_init", where),
    )
    if not -1 <= settings["decay_rate"] < 0 or (
        settings["lr"] is None and not settings["relative_step"]
    ):
        raise RequestError(f"{where}: Adafactor's decay_rate {decay_rate!r} / lr: not steppable")
    said = ", ".join(f"{k} {v}" for k, v in settings.items())
    return transforms.hf_adafactor(**settings), [f"transformers' Adafactor: {said}"]


def filled_state(
    tx: Any, params: Any, opt_state: dict, step: int, where: str
) -> tuple[Any, list[str]]:
    """``tx``'s state with the imported moments, found by the field optax names each (``trace``,
    ``mu``, a Muon ``momentum``, Adafactor's ``row``...) and the parameter's path; counts are
    ``step``. A parameter the run saved no state for starts at zeros, and is said.

    Args:
        tx: the chain.
        params: the restored parameters.
        opt_state: the restored ``opt_state`` tree (``{torch state: {param...}}``).
        step: the optimizer's step count.
        where: the checkpoint, for errors."""
    import jax
    import jax.numpy as jnp

    depth = {len(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    fresh: set[str] = set()

    def fill(path, shaped):
        names = [getattr(k, "name", None) for k in path]
        field = next((n for n in reversed(names) if n is not None), None)
        if field == "count":
            return jnp.asarray(step, shaped.dtype)
        moment = _STATE_OF.get(field or "")
        tail = next((path[-d:] for d in depth if d and len(path) >= d), ())
        value = opt_state.get(moment) if moment else None
        for key in tail if value is not None else ():
            value = value.get(getattr(key, "key", key)) if isinstance(value, dict) else None
        if value is None:
            if moment is not None and shaped.size:
                fresh.add(f"{moment} of {jax.tree_util.keystr(tail)}")
            return jnp.zeros(shaped.shape, shaped.dtype)
        if np.shape(value) != shaped.shape:
            raise RequestError(
                f"{where}: {moment} of {jax.tree_util.keystr(tail)} has shape "
                f"{list(np.shape(value))}, the optimizer keeps {list(shaped.shape)}"
            )
        return value if isinstance(value, jax.Array) else jnp.asarray(value)

    state = jax.tree_util.tree_map_with_path(fill, jax.eval_shape(tx.init, params))
    notes = [f"no saved state, starts at zeros: {', '.join(sorted(fresh))}"] if fresh else []
    return state, notes


#: optax state field -> the torch state name it is written back as
_TORCH_NAME = {
    "trace": "momentum_buffer",
    "momentum": "momentum_buffer",
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "row": "exp_avg_sq_row",
    "col": "exp_avg_sq_col",
    "sq": "exp_avg_sq",
    "avg": "exp_avg",
}


def torch_state_dicts(opt_state: Any, groups: list[dict], kinds: list[str]) -> list[dict]:
    """The continued state as the torch optimizers' ``state_dict()`` dicts (one per optimizer: a
    run of groups of one kind), numpy arrays keyed by index in group order, for
    ``load_state_dict`` after ``torch.from_numpy``: Adam's, Adafactor's and Lion's step is the
    count (a Lion's state: ``exp_avg`` and ``step``, as FusedLion keeps it).

    Args:
        opt_state: the chain's state (params keyed by torch name: no spec).
        groups: the recorded ``param_groups`` (``params``: torch names).
        kinds: each group's optimizer (:func:`kind_of`)."""
    import jax

    per: dict[str, dict[str, Any]] = {}
    count = None
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        names = [getattr(k, "name", None) for k in path]
        field = next((n for n in reversed(names) if n is not None), None)
        if field == "count":
            count = int(leaf)
            continue
        torch_name = _TORCH_NAME.get(field or "")
        key = getattr(path[-1], "key", None)
        if torch_name is None or not np.size(leaf):
            continue
        if not isinstance(key, str) or not isinstance(path[-2], jax.tree_util.GetAttrKey):
            raise RequestError(
                f"opt_state leaf {jax.tree_util.keystr(path)}: not keyed by torch name"
            )
        per.setdefault(key, {})[torch_name] = np.asarray(leaf)
    out: list[dict] = []
    for i, (group, kind) in enumerate(zip(groups, kinds)):
        if i == 0 or kind != kinds[i - 1]:
            out.append({"state": {}, "param_groups": []})
        one = out[-1]
        start = sum(len(g["params"]) for g in one["param_groups"])
        ids = list(range(start, start + len(group["params"])))
        for index, name in zip(ids, group["params"]):
            state = dict(per.get(name, {}))
            if state and kind == "adam":
                state["step"] = np.asarray(count, np.float32)
            elif state and kind in ("adafactor", "lion"):
                state["step"] = count
            if state:
                one["state"][index] = state
        one["param_groups"].append({**group, "params": ids})
    return out
