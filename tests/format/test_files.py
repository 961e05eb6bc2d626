"""format.files: names and links a checkpoint gives are resolved inside its folder, or refused."""

from __future__ import annotations

import os

import pytest

from jax_ucp._src.format import files


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name, message",
    [
        ("/etc/passwd", r"'/etc/passwd' is an absolute path"),
        ("../x", r"has a '\.\.' part"),
        ("a/../../x", r"has a '\.\.' part"),
        ("a\0b", r"holds a NUL character"),
        ("", r"is not a non-empty string"),
        (7, r"is not a non-empty string"),
    ],
)
def test_inside_refuses_names_leading_out(tmp_path, name, message):
    with pytest.raises(files.UnsafeFileError, match=r"^index\.json: file name .*" + message):
        files.inside(tmp_path, name, "index.json")


@pytest.mark.timeout(120)
def test_inside_follows_links_that_stay_inside_and_refuses_those_that_leave(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "real").write_bytes(b"x")
    (root / "inner").symlink_to("sub/real")
    (tmp_path / "outside").write_bytes(b"y")
    (root / "outer").symlink_to(tmp_path / "outside")
    (root / "dir").symlink_to(tmp_path, target_is_directory=True)
    assert files.inside(root, "inner", "m") == os.path.realpath(root / "sub" / "real")
    assert os.path.samefile(files.inside(root, "sub/real", "m"), root / "sub" / "real")
    for name in ("outer", "dir/outside"):
        with pytest.raises(files.UnsafeFileError, match=r"outside the checkpoint"):
            files.inside(root, name, "m")
    # the checkpoint folder reached through a link is its target: links inside it still count
    (tmp_path / "alias").symlink_to(root, target_is_directory=True)
    assert files.inside(tmp_path / "alias", "inner", "m") == os.path.realpath(root / "sub/real")


@pytest.mark.parametrize(
    "text, number",
    [("5", 5), ("05", 5), ("\u0665", None), ("\uff15", None), ("\u00b2", None), (" 5", None)]
    + [("5\n", None), ("5_0", None), ("", None), ("-1", None)],
)
def test_a_number_in_a_name_is_ascii_digits_only(text, number):
    """``int()`` takes ``٥``, ``５``, `` 5`` and ``5_0``; ``str.isdigit`` passes ``²``, which
    ``int()`` then refuses with a raw ValueError."""
    assert files.name_number(text) == number


def test_two_names_for_one_number_are_refused_naming_both():
    assert files.numbered_names([(10, "b_10"), (2, "a_2")], "/run") == {2: "a_2", 10: "b_10"}
    with pytest.raises(
        files.SourceError, match=r"^/run: 'epoch_05' and 'epoch_5' both name epoch 5"
    ):
        files.numbered_names([(5, "epoch_5"), (0, "epoch_0"), (5, "epoch_05")], "/run", "epoch")


#: modules whose numbers-in-names are another change's (the resume's step names; the
#: verify --against engineer's rank files): remove an entry once its module reads ASCII


def _unicode_digit_uses(path: str) -> list[str]:
    """Where ``path`` parses digits the Unicode way: a ``\\d`` in a string that is not a
    docstring (a regular expression), or ``.isdigit()`` / ``.isnumeric()`` / ``.isdecimal()``
    without ``.isascii()`` on its line."""
    import ast

    text = open(path, encoding="utf-8").read()
    tree = ast.parse(text)
    # ``isascii() and isdigit()`` on one line reads ASCII digits (or tells the others apart)
    ascii_lines = {n for n, line in enumerate(text.splitlines(), 1) if ".isascii()" in line}
    docstrings = {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "\\d" in node.value
            and id(node) not in docstrings
        ):
            found.append(f"line {node.lineno}: \\d in {node.value[:60]!r}")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("isdigit", "isnumeric", "isdecimal")
            and node.lineno not in ascii_lines
        ):
            found.append(f"line {node.lineno}: .{node.attr}()")
    return found


def test_every_number_the_project_parses_from_a_name_is_ascii():
    """``\\d`` matches ``١`` and ``５``, ``str.isdigit`` passes ``²``: a rank, epoch or step
    read that way lets a planted file stand in for a real one. Numbers are read with
    ``[0-9]`` (:data:`files.DIGITS`, :func:`files.name_number`) everywhere in jax_ucp/_src."""
    root = os.path.dirname(os.path.dirname(files.__file__))
    bad = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if name.endswith(".py") and (uses := _unicode_digit_uses(path)):
                bad[rel] = uses
    assert not bad, f"Unicode digits parsed (use [0-9] or files.name_number): {bad}"
