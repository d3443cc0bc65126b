"""The docs cannot drift from the code: docs/ARCHITECTURE.md names every module in its
layer, in tests/test_layers.py's order; the modules, classes and functions the docs name in
code exist; every file path README.md and docs/*.md name exists; docs/FLAGS.md is what
``python -m shmrl.run --flags-markdown`` generates and lists the flags of ``--help``; the
README stays short.

(docs/RLLINK.md's byte-level examples are checked by tests/test_docs_rllink.py.)
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_layers import FACES, LAYERS, all_modules

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A file of the repository, as the docs name them: shmrl/trainer/loop.py, tests/test_layers.py, ...
REPO_PATH = re.compile(r"(?<![\w/.-])((?:shmrl|tests|tools|examples|docs|\.ci)/[\w./-]*\w)")
# A name in code: shmrl.sim.run_simulator, sim.run_simulator, Serving.publish, Actor.act(obs)
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
# File names are not names in code: metrics.jsonl, presets.toml, run.lock.
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "toml", "onnx", "npz", "png", "lock", "yml", "yaml", "txt"}


def table(text: str, header_start: str) -> list[list[str]]:
    """The rows (as lists of cells) of the Markdown table whose header line starts with
    ``header_start``; cells split on ``|`` not escaped as ``\\|``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header_start)), None)
    assert start is not None, f"no table whose header starts with {header_start!r}"
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))])
    return rows


def module_files() -> dict[str, Path]:
    """Every module of shmrl/ by its name under shmrl ("sim", "transport.tcp", "__init__"
    for the package, "transport" for shmrl/transport/__init__.py). A folder's ``__init__``
    that holds only its docstring is the folder, not a module of its own."""
    return {("__init__" if name == "shmrl" else name.removeprefix("shmrl.")): path
            for name, path in all_modules().items() if not only_a_docstring(path)}


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                                              for node in body)


# ---------------------------------------------------------------- the layers and the modules

@pytest.mark.parametrize("doc", [ARCHITECTURE], ids=lambda p: p.name)
def test_the_layers_table_is_test_layers_in_its_order_with_every_module(doc):
    """One row per folder of shmrl/ (``client/``), bottom first, then the faces; each row
    names every module of its folder by its name there (``simulator``, ``inference.base``)."""
    rows = table(doc.read_text(), "| layer")
    assert [row[0].strip("`").rstrip("/") for row in rows] == list(LAYERS), \
        f"{doc.name}'s layers table must list tests/test_layers.py's LAYERS, in that order"
    modules = module_files()
    for row, layer in zip(rows, LAYERS):
        named = set(CODE_SPAN.findall(row[1]))
        if layer == "faces":
            inside = set(FACES)
        else:
            inside = {name.removeprefix(layer + ".") for name in modules
                      if name.startswith(layer + ".")}
        missing = sorted(inside - named)
        assert not missing, f"layer {layer!r}: {doc.name} does not name {missing}"
        unknown = sorted(named - inside)
        assert not unknown, f"layer {layer!r}: {doc.name} names {unknown}, which shmrl/{layer}/ does not have"


def test_architecture_names_every_module():
    text = ARCHITECTURE.read_text()
    spans = set(CODE_SPAN.findall(text))
    unnamed = [name for name in module_files()
               if name not in spans and name.rsplit(".", 1)[-1] not in spans and name.replace(".", "/") not in spans
               and f"shmrl/{name.replace('.', '/')}.py" not in text]
    assert not unnamed, f"docs/ARCHITECTURE.md does not name the modules {unnamed}"


# ---------------------------------------------------------------- names and paths the docs give

def top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """What a module defines or imports at its top level, by name."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
    return names


def members(cls: ast.ClassDef) -> set[str]:
    """A class's methods and attributes: class-level ones and ``self.x = ...`` anywhere in
    it (its bases are not followed)."""
    found = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
    return found


class Code:
    """shmrl's modules, parsed: what ``sim.run_simulator`` or ``Serving.publish`` names."""

    def __init__(self):
        self.paths = module_files()
        self.modules = {name: ast.parse(path.read_text()) for name, path in self.paths.items()}
        self.names = {name: top_level_names(tree) for name, tree in self.modules.items()}
        by_short: dict = {}
        for name in self.modules:
            parts = name.split(".")
            for i in range(1, len(parts)):
                by_short.setdefault(".".join(parts[i:]), []).append(name)
        # "sim" -> "sim", "tcp" -> "transport.tcp", "inference.base" -> "server.inference.base";
        # full names too ("transport.tcp").
        self.module_of = {short: names[0] for short, names in by_short.items() if len(names) == 1}
        self.module_of.update({name: name for name in self.modules})
        classes: dict = {}
        for names in self.names.values():
            for n, node in names.items():
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(n, []).append(node)
        self.classes = {n: nodes[0] for n, nodes in classes.items() if len(nodes) == 1}

    def problem(self, dotted: str) -> str | None:
        """Why ``dotted`` names nothing in shmrl, or None; None too for what is not a name of
        shmrl's (``client.send``, ``os.pipe``, ``metrics.jsonl``): only names that start at a
        module of shmrl or at one of its classes are checked."""
        parts = dotted.split(".")
        if parts[-1] in FILE_SUFFIXES:
            return None
        full = parts[0] == "shmrl"
        if full:
            parts = parts[1:]
        # The longest prefix that is a module, then a name in it, then a member of that class.
        for cut in range(len(parts), 0, -1):
            module = self.module_of.get(".".join(parts[:cut]))
            if module is not None:
                rest = parts[cut:]
                break
        else:
            if full:                      # shmrl.train: the package's own names
                module, rest = "__init__", parts
            elif parts[0] in self.classes and len(parts) == 2:
                return None if parts[1] in members(self.classes[parts[0]]) else \
                    f"class {parts[0]} has no {parts[1]!r}"
            else:
                return None
        if not rest:
            return None
        where = self.paths[module].relative_to(ROOT)
        node = self.names[module].get(rest[0])
        if node is None:
            return f"{where} has no top-level {rest[0]!r}"
        if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in members(node):
            return f"class {rest[0]} in {where} has no {rest[1]!r}"
        return None


def test_the_names_in_code_of_the_docs_exist():
    """``trainer.update``, ``Serving.publish``, ``shmrl.sim.run_simulator``: a rename in the
    code that the docs did not follow fails here."""
    code = Code()
    problems = []
    for doc in DOCS:
        for span in CODE_SPAN.findall(doc.read_text()):
            match = DOTTED.match(span.strip())
            if match:
                why = code.problem(match.group(1))
                if why:
                    problems.append(f"{doc.relative_to(ROOT)}: `{span}`: {why}")
    assert not problems, "\n".join(problems)


def test_every_file_the_docs_name_exists():
    missing = sorted({f"{doc.relative_to(ROOT)}: {path}" for doc in DOCS
                      for path in REPO_PATH.findall(doc.read_text()) if not (ROOT / path).exists()})
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)


def test_the_checks_see_what_they_look_for():
    """The checker itself: a wrong module, function, method or path is caught; names that
    are not shmrl's pass."""
    code = Code()
    assert code.problem("sim.run_simulator") is None
    assert code.problem("shmrl.sim.run_simulator") is None
    assert code.problem("shmrl.train") is None and code.problem("shmrl.Config") is None
    assert code.problem("Serving.publish") is None and code.problem("Hub.waiting") is None
    assert code.problem("transport.tcp.TcpServer") is None and code.problem("tcp.TcpServer") is None
    assert "no top-level 'run_simulatr'" in code.problem("sim.run_simulatr")
    assert "has no 'publsh'" in code.problem("Serving.publsh")
    assert "has no 'act2'" in code.problem("actor.Actor.act2")
    assert "shmrl/transport/__init__.py has no top-level 'conect'" in code.problem("shmrl.transport.conect")
    assert code.problem("client.send") is None and code.problem("os.pipe") is None
    assert REPO_PATH.findall("see `shmrl/learner.py` and tools/solve.py.") == \
        ["shmrl/learner.py", "tools/solve.py"]
    rows = table("x\n| flag | a |\n|---|---|\n| `--a\\|b` | c |\n\n| other |", "| flag")
    assert rows == [["`--a\\|b`", "c"]]


# ---------------------------------------------------------------- docs/FLAGS.md, generated

FLAGS = ROOT / "docs" / "FLAGS.md"


def help_flags() -> set[str]:
    """The flags of ``python -m shmrl.run --help``: those its option lines start with
    (``  --sims SIMS  ...``, ``  --tensorboard, --no-tensorboard``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "shmrl.run", "--help"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    options = [line.strip().split("  ")[0] for line in out.stdout.splitlines() if line.startswith("  -")]
    return {flag for option in options for flag in re.findall(r"--[a-z][a-z0-9-]*", option)} - {"--help"}


def test_the_flag_reference_is_generated_from_the_code():
    from shmrl.run import flags_markdown

    assert FLAGS.read_text() == flags_markdown(), \
        "docs/FLAGS.md is stale: python -m shmrl.run --flags-markdown > docs/FLAGS.md"


def test_the_flag_reference_and_help_list_the_same_flags():
    listed = {flag for line in FLAGS.read_text().splitlines() if line.startswith("| `--")
              for flag in re.findall(r"--[a-z][a-z0-9-]*", line.split(" | ")[0])}
    assert listed == help_flags(), sorted(listed ^ help_flags())
    assert "`CartPole-v1`: `0.005`" in FLAGS.read_text()       # each env's own default is there too
    assert "family continuous: `True`" in FLAGS.read_text()    # and each family's (--async)


def test_the_readme_is_short_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 210     # a new user's page, with its table of headline figures
    assert "## How fast" in text and "docs/FIGURES.md" in text
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    unlinked = [page for page in pages if f"(docs/{page})" not in text]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_every_relative_link_of_the_docs_resolves():
    """A page moved into docs/ keeps links that work from where it now is."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = target.split("#")[0]
            if path and not target.startswith(("http://", "https://")) and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)
