"""The layers of docs/ARCHITECTURE.md, enforced folder by folder: every module of shmrl/
lives in the folder of its layer (or is one of the faces at the top), imports only from its
own folder and the folders below (function-level imports count), nothing imports in a
circle (in shmrl/ and in tools/), and no module or function grows past what a reader takes
in at once.

Imports are read from the source with ``ast``, so a lazy import inside a function counts
as much as one at the top; ``importlib.import_module`` of a computed name (user
factories, PettingZoo families) is not an import of shmrl's.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shmrl"
TOOLS = ROOT / "tools"

# From the bottom up: a folder of shmrl/ may import from itself and from the folders
# listed before it. "faces" are the modules at the top of shmrl/.
LAYERS = ["config", "core", "files", "rllink", "transport", "onnxio", "envs", "client", "model", "server",
          "checker", "launch", "trainer", "faces"]
# The modules at the top of shmrl/: the command lines, the Python API, and the
# compatibility paths of docs/EXTERNAL.md. At most 8.
FACES = ["__init__", "run", "sim", "eval", "record", "plot", "conformance", "onnx_policy"]
# What a folder must never reach, even through the folders it may import: the client side
# runs in simulators (numpy and onnxruntime only), as do the env adapters and the ONNX policy.
NEVER = {
    "client": {"model", "server", "checker", "launch", "trainer"},
    "envs": {"model", "server", "trainer"},
    "onnxio": {"model"},
    "model": {"transport", "server", "client"},
}
NO_TORCH = ["config", "core", "files", "rllink", "transport", "onnxio", "envs", "client"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(folder: Path = PACKAGE, root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(folder.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    """``shmrl.client.actor`` -> ``client``; a module at the top -> ``faces``."""
    if module == "shmrl":
        return "faces"
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in FACES:
        return "faces"
    return parts[1] if len(parts) > 2 or parts[1] in LAYERS else None


def imports_of(module: str, path: Path, known: set, prefix: str = "shmrl") -> tuple[set, set]:
    """(the modules of ours ``module`` imports, the top-level names of other packages it
    imports), from every import statement in it, nested ones included. ``from pkg import
    name`` imports ``pkg.name`` when that is a module, else the package ``pkg`` itself
    (its ``__init__`` holds ``name``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours, theirs = set(), set()

    def add(name: str) -> None:
        if name == prefix or name.startswith(prefix + "."):
            while name not in known and "." in name:
                name = name.rpartition(".")[0]
            ours.add(name)
        else:
            theirs.add(name.split(".")[0])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the package of this module, up level - 1
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
    # Importing shmrl.x runs shmrl/__init__ first; that is not an import of the face.
    ours.discard(prefix)
    ours.discard(module)
    return ours, theirs


def import_graph(folder: Path = PACKAGE, root: Path = ROOT, prefix: str = "shmrl") -> tuple[dict, dict]:
    modules = all_modules(folder, root)
    known = set(modules)
    graph, external = {}, {}
    for name, path in modules.items():
        ours, theirs = imports_of(name, path, known, prefix)
        graph[name] = ours & known
        external[name] = theirs
    return graph, external


def find_cycle(graph: dict) -> list | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict = {}   # module -> "open" while on the path, "done" after
    path: list = []

    def visit(m: str):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def closure(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def test_the_folders_are_the_layers():
    """Every folder of shmrl/ is a layer, every layer a folder, and at most 8 modules sit
    at the top: a new module fails here until it is placed in its layer's folder."""
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(set(LAYERS) - {"faces"}), f"folders {folders} against the layers {LAYERS}"
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert sorted(top) == sorted(FACES), f"modules at the top of shmrl/: {top}; the faces are {FACES}"
    assert len(FACES) <= 8
    unplaced = [m for m in all_modules() if layer_of(m) is None]
    assert not unplaced, f"{unplaced}: not in a layer's folder"


def test_no_import_cycle_in_shmrl_or_tools():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    tools_graph, _ = import_graph(TOOLS, ROOT, "tools")
    cycle = find_cycle(tools_graph)
    assert cycle is None, "import cycle in tools/: " + " -> ".join(cycle)


def test_imports_only_point_down():
    order = {layer: i for i, layer in enumerate(LAYERS)}
    graph, _ = import_graph()
    upward = [f"{m} ({layer_of(m)}) imports {n} ({layer_of(n)})"
              for m, targets in sorted(graph.items()) for n in sorted(targets)
              if order[layer_of(n)] > order[layer_of(m)]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


@pytest.mark.parametrize("folder", sorted(NEVER))
def test_a_folder_never_reaches_what_it_must_not(folder):
    """``client/`` never imports ``model/``, ``server/``, ``checker/``, ``launch/`` or
    ``trainer/``, not even through a module it may import; likewise the others of NEVER."""
    graph, _ = import_graph()
    for start in (m for m in graph if layer_of(m) == folder):
        reached = {layer_of(m) for m in closure(graph, start)}
        assert not reached & NEVER[folder], f"{start} reaches {sorted(reached & NEVER[folder])}"


def test_the_client_side_never_imports_torch():
    graph, external = import_graph()
    for start in (m for m in graph if layer_of(m) in NO_TORCH):
        reached = closure(graph, start)
        through = sorted(m for m in reached if "torch" in external[m])
        assert not through, f"{start} imports torch through {through}"


def test_no_package_init_imports_torch():
    """Importing any package of shmrl (its ``__init__``, and so what it names) loads no
    torch: a simulator that imports ``shmrl.rllink`` or ``shmrl.trainer``'s API stays small."""
    inits = sorted(module_name(p) for p in PACKAGE.rglob("__init__.py"))
    assert len(inits) >= len(LAYERS)
    assert torch_modules_after_importing(inits) == []


def torch_modules_after_importing(modules: list[str]) -> list[str]:
    """The torch modules a fresh interpreter has loaded after importing ``modules``."""
    code = (f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip())


def test_no_module_or_function_too_long():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.name}: {n} lines")
    assert not too_long, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function:\n"
                          + "\n".join(too_long))


def test_importing_a_simulator_and_eval_loads_no_torch():
    assert torch_modules_after_importing(["shmrl.client.actor", "shmrl.client.simulator", "shmrl.client.multi_agent",
                                          "shmrl.sim", "shmrl.eval", "shmrl.envs.make", "shmrl.transport"]) == []


def test_the_checks_catch_what_they_look_for():
    """The checker itself: a cycle, an upward import, a relative import and a package's
    re-export are seen."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph, _ = import_graph()
    assert "shmrl.rllink" in graph["shmrl.client.simulator"]     # ``from shmrl import rllink``: the package's API
    assert "shmrl.transport" in graph["shmrl.client.simulator"]  # a function-level import
    assert "shmrl.transport.ring" in graph["shmrl.transport.shm"]
    assert "shmrl.rllink.codec" in graph["shmrl.rllink"]         # the package's __init__ and what it names
    assert layer_of("shmrl.transport.tcp") == "transport" and layer_of("shmrl") == "faces"
    assert layer_of("shmrl.server.inference.base") == "server" and layer_of("shmrl.stray") is None
    order = {layer: i for i, layer in enumerate(LAYERS)}
    assert order["client"] < order["model"] < order["server"] < order["trainer"]
