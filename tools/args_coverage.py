"""How many public functions of jax_ucp/ with 3+ parameters have an ``Args:`` section.

Public: a module-level function or a method of a module-level class, neither name nor class
starting with ``_``, in a module whose path has no ``_private`` part (``jax_ucp/_src/``, where
the code behind the public facades lives, counts). ``self``/``cls`` do not
count as parameters; ``*args``/``**kwargs`` do. Typer commands (decorated ``...command(...)``)
are left out: their docstring is the command's ``--help`` and each option has its own ``help=``.
``--missing`` lists those without one.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jax_ucp"


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def functions():
    """(qualified name, has Args:) of every public function with 3+ parameters."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        if any(p.startswith("_") and p not in ("__init__.py", "_src") for p in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts)
        tree = ast.parse(path.read_text())
        found = [(n, "", False) for n in tree.body]
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found += [(m, node.name + ".", True) for m in node.body]
        for fn, owner, method in found:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if fn.name.startswith("_") or _params(fn, method) < 3:
                continue
            if any("command" in ast.unparse(d) for d in fn.decorator_list):
                continue
            doc = ast.get_docstring(fn) or ""
            yield f"{module}.{owner}{fn.name}", "Args:" in doc


def main() -> None:
    """Prints the count and share; with ``--missing``, the functions without ``Args:``."""
    rows = list(functions())
    with_args = sum(has for _, has in rows)
    print(f"{with_args}/{len(rows)} = {100 * with_args / max(len(rows), 1):.1f} % have Args:")
    if "--missing" in sys.argv:
        for name, has in rows:
            if not has:
                print("  ", name)


if __name__ == "__main__":
    main()
