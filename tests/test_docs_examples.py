"""Every block of README.md and docs/*.md that shows code runs in CI, or is counted as not run.

tests/test_docs_snippets.py runs each complete ```python block alone. The rest are run here:

- a ```python block with a ``<!-- docs-test: ... -->`` comment right above its fence is an
  excerpt: it runs in a fresh process (8 CPU devices, a temporary working directory) after the
  names its prose assumes are defined (a prelude of this file, named in the comment), with the
  placeholders it names (``"out/checkpoint-3"``, ``SRC``) replaced by the real fixtures the
  comment maps them to;
- a ```python block whose comment only marks it (``torch``, ``slow``) is whole: it runs as a
  reader copies it (nothing defined, replaced or set for it), in the stage its mark names;
- a ```bash block runs its ``jax-ucp`` commands (each line in order, in one temporary directory,
  placeholders mapped the same way; ``pip install`` steps are the environment's, not run; a
  ``# ✓ TEXT: figures`` comment is output one of them must print);
- an excerpt of a class's definition (``excerpt: module.Class``, any fence) lists only members
  the class has;
- a block that cannot run here says why (``skip: <reason>``) and is counted: SKIPPED records how
  many each file has, so a new unrunnable block fails until it is counted here;
- every other block (```text, bare, json, toml) is output, a layout or a table: one that parses
  as Python is an excerpt that escaped the runners, and fails.

The comment's items, separated by ``;``: ``torch`` or ``slow`` (the pytest mark: the block runs
in CI's torch stage, ``-m "torch or slow"``), ``prelude: NAME`` (PRELUDES), ``excerpt:
module.Class``, ``"text" = PATH`` (that quoted string, or that shell word, replaced by PATH),
``NAME = PATH`` (NAME defined as PATH) and, last, ``skip: REASON``. A PATH under tests/ or
jax_ucp/ is the repository's (and must exist); any other is relative to the block's temporary
working directory. A mapping the block does not use is an error, so the comment cannot drift
from its block.
"""

from __future__ import annotations

import ast
import glob
import importlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

from tests.ucp_testing import FIXTURES, REPO

pytestmark = pytest.mark.timeout(400)

FILES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--[ \t]*docs-test:((?:(?!-->).)*)-->[ \t]*\n\Z", re.S)

# Blocks marked ``skip`` in each file: the reviewed count (a new unrunnable block fails here).
SKIPPED = {
    "README.md": 2,  # the Quickstart, the torch set-up (installs)
    "docs/ELASTIC.md": 2,
    "docs/EXPORT.md": 2,
    "docs/HF.md": 1,
    "docs/RELIABILITY.md": 1,
    "docs/TORCH.md": 1,
}

_MESH = """
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
rules = [("embed", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model")]
"""


def _block_with(name: str, needle: str) -> str:
    """The one ```python block of a doc that contains ``needle``: a prelude that is the doc's
    own end-to-end example, so an excerpt of it runs on the state that example builds."""
    found = [b.code for b in fenced(name) if b.lang == "python" and needle in b.code]
    assert len(found) == 1, f"{name}: {len(found)} python blocks contain {needle!r}"
    return found[0]


# The names an excerpt's prose assumes, by the name its comment gives (the code runs first, in
# the excerpt's namespace). Every prelude has os (8 CPU devices set), json, jax, numpy as np and
# jax_ucp imported.
PRELUDES = {
    # SPEC: the shipped hf_llama spec with the head settings of the Trainer DeepSpeed fixture's
    # config.json (the model of the sources the excerpts' SPEC is used on)
    "mesh_ds_spec": lambda: (
        _MESH
        + textwrap.dedent(
            f"""
        from jax_ucp.language import load_spec
        from jax_ucp.models import LMConfig

        with open({os.path.join(FIXTURES, "hf_trainer/trainer_ds_z2/checkpoint-3/config.json")!r}) as f:
            SPEC = load_spec("hf_llama", **LMConfig.from_hf_llama(json.load(f)).head_settings)
        """
        )
    ),
    # the abstract state of the fixture run root's tree (what the job's own init would give)
    "elastic": lambda: textwrap.dedent(
        """
        import jax.numpy as jnp

        abstract_state = jax.eval_shape(
            lambda: {"params": {"w": jnp.zeros((8, 16)), "b": jnp.zeros(16, jnp.int32)}, "step": 0}
        )
        """
    ),
    # a flax TransformerLM checkpoint (ckpt) restored from the shipped Trainer sample's weights
    # through hf_llama, and that model's config.json (in the working directory)
    "export_lm": lambda: textwrap.dedent(
        """
        import shutil

        from jax_ucp import samples
        from jax_ucp.conversion import ImportOptions
        from jax_ucp.exporters import SafetensorsExport
        from jax_ucp.language import load_spec
        from jax_ucp.models import LMConfig

        _src = samples.path("hf_trainer_llama")
        shutil.copy(os.path.join(_src, "config.json"), "config.json")
        with open("config.json") as _f:
            _settings = LMConfig.from_hf_llama(json.load(_f)).head_settings
        _tree = jax_ucp.restore(
            _src, spec=load_spec("hf_llama", **_settings),
            importing=ImportOptions(weights_only=True),
        )
        ckpt = jax_ucp.save(os.path.abspath("lm_ucp"), {"params": _tree["params"]})
        """
    ),
    # docs/NNX.md's end-to-end example (run_root, new_mesh, RULES, Model, ...): the excerpts
    # name its rules ``rules``
    "nnx": lambda: _block_with("docs/NNX.md", "def build(mesh)") + "\nrules = RULES\n",
    # the same, then the run saved again by plain Orbax (StandardSave), the comparison's side
    "nnx_orbax": lambda: (
        _block_with("docs/NNX.md", "def build(mesh)")
        + textwrap.dedent(
            """
        tx = optax.adamw(1e-2)
        run_root = tempfile.mkdtemp()
        step = 3
        mngr = ocp.CheckpointManager(run_root)
        model, optimizer = build(mesh)
        state = {"model": nnx.state(model), "opt": nnx.state(optimizer), "step": step}
        mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        """
        )
    ),
}

# Runs in the child: the prelude, then the block (line numbers padded to the Markdown file's). A
# whole block (no prelude, names or placeholders: only a mark) runs as a reader copies it, in a
# bare namespace with no XLA_FLAGS set for it.
RUNNER = textwrap.dedent(
    """
    import sys

    doc, line, whole = sys.argv[1], int(sys.argv[2]), sys.argv[5] == "whole"
    prelude, source = open(sys.argv[3]).read(), open(sys.argv[4]).read()
    scope = {"__name__": "__main__"}
    if not whole:
        import os

        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        import json

        import jax
        import numpy as np

        import jax_ucp

        scope.update(os=os, json=json, jax=jax, np=np, jax_ucp=jax_ucp)
        exec(compile(prelude, "<docs-test prelude>", "exec"), scope)
    exec(compile("\\n" * (line - 1) + source, doc, "exec"), scope)
    """
)

# Runs a ``jax-ucp`` command line in the child, as the installed script does.
CLI = "import sys\nfrom jax_ucp.cli import main\nsys.argv[0] = 'jax-ucp'\nmain()\n"


@dataclass
class Block:
    name: str
    line: int  # first line of the code
    lang: str
    code: str
    marker: str | None  # the docs-test comment's text, None without one
    marks: set[str] = field(default_factory=set)
    prelude: str | None = None
    skip: str | None = None
    excerpt: str | None = None  # module.Class the block excerpts
    literals: dict[str, str] = field(default_factory=dict)  # "text" or shell word -> path
    names: dict[str, str] = field(default_factory=dict)  # NAME -> path

    @property
    def whole(self) -> bool:
        """Runs as written: nothing defined or replaced for it."""
        return not (self.prelude or self.names or self.literals)

    @property
    def id(self) -> str:
        return f"{self.name}:{self.line}"


def _parse_marker(block: Block) -> None:
    assert block.marker is not None
    head, skip, reason = block.marker.partition("skip:")  # the reason, last, may hold ";"
    if skip:
        assert reason.strip(), f"{block.id}: docs-test skip with no reason"
        block.skip = " ".join(reason.split())
    for item in filter(None, (s.strip() for s in head.split(";"))):
        m = re.fullmatch(r'("[^"]+"|[A-Za-z_]\w*)\s*([:=])\s*(\S.*)', item, re.S)
        key, sep, value = m.groups() if m else (item, "", "")
        if item in ("torch", "slow"):
            block.marks.add(item)
        elif (key, sep) == ("excerpt", ":"):
            block.excerpt = value
        elif (key, sep) == ("prelude", ":") and value in PRELUDES:
            block.prelude = value
        elif sep == "=" and key.startswith('"'):
            block.literals[key[1:-1]] = value
        elif sep == "=":
            block.names[key] = value
        else:
            raise AssertionError(f"{block.id}: docs-test item {item!r} not understood")


def fenced(name: str) -> list[Block]:
    """Every fenced block of a Markdown file, with the docs-test comment right above it."""
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        marker = MARKER.search(text, max(0, m.start() - 2000), m.start())
        block = Block(
            name=name,
            line=text.count("\n", 0, m.start(2)) + 1,
            lang=m.group(1).strip(),
            code=m.group(2),
            marker=marker.group(1) if marker else None,
        )
        if block.marker is not None:
            _parse_marker(block)
        out.append(block)
    return out


ALL = [b for name in FILES for b in fenced(name)]
RUN = [b for b in ALL if b.marker is not None and b.skip is None and b.excerpt is None]
EXCERPTS = [b for b in ALL if b.excerpt is not None]


def _path(block: Block, value: str) -> str:
    if value.startswith(("tests/", "jax_ucp/")):
        path = os.path.join(REPO, value)
        assert os.path.exists(path), f"{block.id}: docs-test maps to {value}, which is not there"
        return path
    return value  # in the block's working directory


def _python(block: Block) -> tuple[str, str]:
    """(prelude, code) of an excerpt, its placeholders replaced."""
    code = block.code
    for text, value in block.literals.items():
        quoted = [q + text + q for q in "\"'" if q + text + q in code]
        assert quoted, f"{block.id}: docs-test maps {text!r}, which the block does not quote"
        for q in quoted:
            code = code.replace(q, repr(_path(block, value)))
    prelude = PRELUDES[block.prelude]() if block.prelude else ""
    for name, value in block.names.items():
        assert re.search(rf"\b{name}\b", code), f"{block.id}: docs-test defines unused {name}"
        prelude += f"\n{name} = {_path(block, value)!r}\n"
    return prelude, code


def _commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists, placeholders replaced; ``pip install`` steps
    (the environment's) dropped. Anything but ``jax-ucp`` is refused: this runner runs only
    the package's own command."""
    used: set[str] = set()
    commands = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        steps: list[list[str]] = [[]]
        for w in words:
            if w == "&&":
                steps.append([])
            else:
                steps[-1].append(w)
        for step in filter(None, steps):
            if step[:2] == ["pip", "install"]:
                continue
            assert step[0] == "jax-ucp", f"{block.id}: only jax-ucp commands run here: {step}"
            args = []
            for w in step[1:]:
                if w in block.literals:
                    used.add(w)
                    w = _path(block, block.literals[w])
                args.append(w)
            commands.append(args)
    unused = set(block.literals) - used
    assert not unused, f"{block.id}: docs-test maps {sorted(unused)}, which no command names"
    assert not block.names, f'{block.id}: a shell block maps words ("word" = PATH), not names'
    assert not block.prelude, f"{block.id}: a shell block has no prelude"
    return commands


def _shown(block: Block) -> list[str]:
    """What the block says a command prints: a ``# ✓ TEXT: figures`` comment's TEXT (the
    figures depend on the versions that ran)."""
    return [
        " ".join(m.group(1).split()) for m in re.finditer(r"^#\s*(✓[^:\n]*):", block.code, re.M)
    ]


def _env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path / "tmp"), COLUMNS="200")
    return env


def _params():
    for b in RUN:
        marks = [getattr(pytest.mark, m) for m in sorted(b.marks)]
        yield pytest.param(b, marks=marks, id=b.id)


def test_every_code_block_is_run_or_counted():
    """A block that parses as Python is a ```python block (run alone, or as an excerpt), one of
    shell commands a ```bash block, run or skipped with a reason; the skipped ones are the
    counted ones."""
    skipped: dict[str, int] = {}
    for b in ALL:
        if b.lang in ("python", "bash"):
            if b.lang == "bash":
                assert b.marker is not None, f"{b.id}: a bash block with no docs-test comment"
            if b.skip:
                skipped[b.name] = skipped.get(b.name, 0) + 1
            continue
        assert b.marker is None or b.excerpt, f"{b.id}: a docs-test comment on a ```{b.lang} block"
        if b.excerpt:
            continue
        if b.lang in ("json", "toml"):
            continue
        assert not re.search(r"^\$?[ \t]*(jax-ucp|python3?|pip)[ \t]", b.code, re.M), (
            f"{b.id}: a ```{b.lang or 'bare'} block of shell commands: fence it ```bash"
        )
        try:
            tree = ast.parse(b.code)
        except SyntaxError:
            continue
        assert all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Name) for s in tree.body), (
            f"{b.id}: a ```{b.lang or 'bare'} block that is Python: fence it ```python, "
            "with a docs-test comment if it is an excerpt"
        )
    print(f"docs blocks: {len(ALL)}, run here: {len(RUN)}, skipped: {skipped}")
    assert skipped == SKIPPED, f"skipped blocks per file {skipped}, recorded {SKIPPED}"


#: pages whose every Python block runs as a reader copies it: no prelude, name or placeholder
WHOLE_PAGES = ("docs/DEEPSPEED.md", "docs/MEGATRON.md", "docs/TORCH.md")


def test_the_framework_pages_have_no_excerpt():
    """A Megatron, DeepSpeed or torch user copies a block from these pages into a file and runs
    it: each is whole (its imports, mesh, rules and data its own), marked at most by the stage
    it needs, or skipped with why."""
    for b in ALL:
        if b.name in WHOLE_PAGES and b.lang == "python" and b.marker is not None and not b.skip:
            assert b.whole, f"{b.id}: an excerpt (prelude, names or placeholders); make it whole"


@pytest.mark.parametrize("block", list(_params()))
def test_docs_example_runs(tmp_path, block: Block):
    work = tmp_path / "cwd"
    work.mkdir()
    (tmp_path / "tmp").mkdir()
    env = _env(tmp_path)
    if block.lang == "bash":
        output: list[str] = []
        for args in _commands(block):
            r = subprocess.run(
                [sys.executable, "-c", CLI, *args],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert r.returncode == 0, (
                f"{block.id}: jax-ucp {shlex.join(args)} exited {r.returncode}:\n"
                f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
            )
            output.append(" ".join(r.stdout.split()))
        for shown in _shown(block):
            assert any(shown in o for o in output), f"{block.id}: no command printed {shown!r}"
        return
    prelude, code = _python(block)
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "prelude.py").write_text(prelude)
    (tmp_path / "block.py").write_text(code)
    r = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), os.path.join(REPO, block.name)]
        + [str(block.line), str(tmp_path / "prelude.py"), str(tmp_path / "block.py")]
        + ["whole" if block.whole else "excerpt"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"{block.id} fails:\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("block", EXCERPTS, ids=[b.id for b in EXCERPTS])
def test_docs_excerpt_names_what_the_class_has(block: Block):
    """An excerpt of a class (``excerpt: module.Class``) shows that class, and every field and
    method it lists is one the class has: a rename or a removal shows up here."""
    assert block.excerpt is not None
    module, _, name = block.excerpt.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert re.search(rf"^class {name}\b", block.code, re.M), f"{block.id}: no class {name}"
    shown = [
        a or b for a, b in re.findall(r"^[ \t]+(?:def[ \t]+(\w+)|(\w+)[ \t]*:)", block.code, re.M)
    ]
    real = set(vars(cls)) | set(getattr(cls, "__annotations__", {}))
    assert shown, f"{block.id}: the excerpt lists no member of {name}"
    missing = [n for n in shown if n not in real]
    assert not missing, f"{block.id}: {block.excerpt} has no {missing}"
