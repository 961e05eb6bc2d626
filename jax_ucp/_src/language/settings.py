"""Spec settings (a plain dict of model hyper-parameters, Megatron's names with common aliases),
integer expressions over them (``"num_layers // pp"``: ``+ - * // %`` and parentheses), and name
templates."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from jax_ucp._src.errors import LanguageError

# canonical name -> accepted aliases
ALIASES: dict[str, tuple[str, ...]] = {
    "num_attention_heads": ("num_heads", "heads", "n_head"),
    "num_query_groups": ("num_kv_heads", "kv_heads", "query_groups", "n_kv_head"),
    "head_dim": ("kv_channels",),
    "hidden_size": ("hidden", "d_model", "n_embd"),
    "ffn_hidden_size": ("ffn_hidden", "intermediate_size"),
    "num_layers": ("layers", "n_layer"),
    "vocab_size": ("orig_vocab_size",),
    "tp": ("tensor_model_parallel_size",),
    "pp": ("pipeline_model_parallel_size",),
    "ep": ("expert_model_parallel_size",),
    "num_experts": ("num_moe_experts",),
}
_CANONICAL_NAME = {alias: canon for canon, al in ALIASES.items() for alias in al}


def canonical(name: str) -> str:
    """A setting's canonical name (an alias such as Hugging Face's spelling maps to it)."""
    return _CANONICAL_NAME.get(name, name)


def normalize(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """Aliases -> canonical names (an error when an alias and its canonical name disagree)."""
    out: dict[str, Any] = {}
    for k, v in (settings or {}).items():
        c = canonical(k)
        if c in out and out[c] != v:
            raise LanguageError(f"setting {k!r} = {v!r} disagrees with {c!r} = {out[c]!r}")
        out[c] = v
    return out


def derived(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Settings with defaults derived from others (num_query_groups, head_dim, padded vocab)."""
    s = normalize(settings)
    if "num_attention_heads" in s and "num_query_groups" not in s:
        s["num_query_groups"] = s["num_attention_heads"]
    if "head_dim" not in s and "hidden_size" in s and "num_attention_heads" in s:
        h, n = _as_int(s["hidden_size"]), _as_int(s["num_attention_heads"])
        if h is not None and n and h % n == 0:
            s["head_dim"] = h // n
    if "vocab_size" in s and "padded_vocab_size" not in s:
        v = _as_int(s["vocab_size"])
        m = _as_int(s.get("make_vocab_size_divisible_by", 1)) or 1
        tp = _as_int(s.get("tp", 1)) or 1
        if v is not None:
            s["padded_vocab_size"] = padded_vocab_size(v, m, tp)
    return s


def hf_head_settings(config: Mapping[str, Any], where: str = "config.json") -> dict[str, int]:
    """The head settings a shipped spec's q/k/v ops need, from a Hugging Face ``config.json``."""
    try:
        gpt2 = "num_attention_heads" not in config  # GPT-2's own names: n_head, n_embd
        heads = int(config["n_head" if gpt2 else "num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        hidden = config["n_embd" if gpt2 else "hidden_size"]
        head_dim = int(config.get("head_dim") or int(hidden) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise LanguageError(
            f"{where}: no head settings (num_attention_heads, hidden_size, optional "
            f"num_key_value_heads and head_dim as integers): {type(e).__name__}: {e}"
        ) from None
    if min(heads, groups, head_dim) <= 0 or heads % groups:
        raise LanguageError(
            f"{where}: num_attention_heads {heads}, num_key_value_heads {groups}, head_dim "
            f"{head_dim}: expected positive integers, the heads a multiple of the groups"
        )
    return {"num_attention_heads": heads, "num_query_groups": groups, "head_dim": head_dim}


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by * tp.

    Args:
        vocab_size: the tokenizer's vocabulary size
        divisible_by: Megatron's ``make_vocab_size_divisible_by``
        tp: tensor-parallel size"""
    m = max(1, int(divisible_by)) * max(1, int(tp))
    return -(-int(vocab_size) // m) * m


def _as_int(v) -> int | None:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str) and re.fullmatch(r"-?[0-9]+", v.strip()):
        return int(v)
    return None


# settings derived when not given (``derived``): what to give instead
_DERIVED_FROM = {
    "head_dim": "hidden_size and num_attention_heads (head_dim = hidden_size // heads)",
    "num_query_groups": "num_attention_heads (no GQA: as many groups as heads)",
    "padded_vocab_size": "vocab_size (with make_vocab_size_divisible_by and tp)",
}


def missing_setting(name: str, env: Mapping[str, Any]) -> str:
    """Why a setting is missing and how to pass it (a shipped spec has no model settings)."""
    canon = canonical(name)
    aliases = ALIASES.get(canon, ())
    text = f"unknown setting {name!r}"
    if aliases or canon != name:
        text += f" (also written {', '.join(n for n in (canon, *aliases) if n != name)})"
    text += ": needed here and not given"
    if canon in _DERIVED_FROM:
        text += f"; it is derived from {_DERIVED_FROM[canon]} when those are given"
    known = ", ".join(sorted(env)) or "none"
    return (
        f"{text} (names known here: {known}). Pass the model's settings with the spec: "
        f"jax_ucp.language.load_spec(<spec name or file>, {canon}=..., ...) or "
        f"spec.with_settings({canon}=...), and that spec as restore(spec=...)"
    )


_BINARY_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


#: Longer or deeper expressions are refused before Python's parser recurses over them.
MAX_EXPRESSION_CHARS = 1000
MAX_EXPRESSION_DEPTH = 64


def _depth(tree: ast.AST) -> int:
    """Nesting depth of an AST, without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def eval_int(expr, env: Mapping[str, Any], *, where: str = "") -> int:
    """An int, or a string expression over ``env`` (settings and captured variables).

    Args:
        expr: an int, or an expression string (``hidden / heads``)
        env: settings and captured variables it may name
        where: the message prefix of an error"""
    v = _as_int(expr)
    if v is not None:
        return v
    if not isinstance(expr, str):
        raise LanguageError(f"{where}expected an integer or an expression string, got {expr!r}")
    return _evaluate(_parse(expr, where), expr, normalize_env(env), where)


def _parse(expr: str, where: str) -> ast.Expression:
    """The AST of a short expression; too long, too deep or no Python is a ``LanguageError``."""
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise LanguageError(
            f"{where}expression {expr[:40]!r}... is {len(expr)} characters long; at most "
            f"{MAX_EXPRESSION_CHARS} are accepted"
        )
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise LanguageError(f"{where}bad expression {expr!r}: {e.msg}") from None
    except (RecursionError, MemoryError):
        tree = None
    if tree is None or _depth(tree) > MAX_EXPRESSION_DEPTH:
        raise LanguageError(
            f"{where}expression {expr[:40]!r}... nests deeper than {MAX_EXPRESSION_DEPTH} levels"
        )
    return tree


def _evaluate(n: ast.AST, expr: str, env: Mapping[str, Any], where: str) -> int:
    """The value of node ``n`` of ``expr``: integers, setting names and + - * // % only."""
    if isinstance(n, ast.Expression):
        return _evaluate(n.body, expr, env, where)
    if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
        return n.value
    if isinstance(n, ast.Name):
        return _setting(n.id, expr, env, where)
    if isinstance(n, ast.BinOp) and type(n.op) in _BINARY_OPERATORS:
        a, b = _evaluate(n.left, expr, env, where), _evaluate(n.right, expr, env, where)
        if isinstance(n.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise LanguageError(f"{where}expression {expr!r} divides by zero")
        return _BINARY_OPERATORS[type(n.op)](a, b)
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
        return -_evaluate(n.operand, expr, env, where)
    raise LanguageError(
        f"{where}expression {expr!r}: only integers, setting names and + - * // % are allowed"
    )


def _setting(name: str, expr: str, env: Mapping[str, Any], where: str) -> int:
    """The integer value of setting ``name`` (canonical spelling) named in ``expr``."""
    canon = canonical(name)
    if canon not in env:
        raise LanguageError(f"{where}expression {expr!r}: {missing_setting(name, env)}")
    val = _as_int(env[canon])
    if val is None:
        raise LanguageError(
            f"{where}expression {expr!r}: setting {name!r} = {env[canon]!r} is not an integer"
        )
    return val


def normalize_env(env: Mapping[str, Any]) -> dict[str, Any]:
    """An expression environment: names also under canonical names, group ``N`` also as ``_N``."""
    out = {}
    for k, v in env.items():
        out[k] = v
        out.setdefault(canonical(k), v)
        if re.fullmatch(r"[0-9]+", k):  # a group number (ASCII, like every number read)
            out["_" + k] = v
    return out


_TEMPLATE_FIELD = re.compile(r"\{([^{}]*)\}")


def render(template: str, env: Mapping[str, Any], *, where: str = "") -> str:
    """``{name}`` -> a variable or setting, ``{expr}`` -> an integer expression; ``{{``/``}}``
    escape.

    Args:
        template: text with ``{name}`` / ``{expr}`` fields
        env: settings and captured variables
        where: the message prefix of an error"""

    def sub(m):
        key = m.group(1).strip()
        if key in env:
            return str(env[key])
        if canonical(key) in env:
            return str(env[canonical(key)])
        return str(eval_int(key, env, where=where))

    return "{".join(
        "}".join(_TEMPLATE_FIELD.sub(sub, x) for x in part.split("}}"))
        for part in template.split("{{")
    )
