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
