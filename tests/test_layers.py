"""The layers of docs/ARCHITECTURE.md, enforced: every module of shmrl/ has a place in
LAYERS, imports only from its own layer or those below (function-level imports count),
nothing imports in a circle, and the client side (the actor, the simulator loops, eval)
never reaches torch, the trainer's model code, the hub or the trainer.

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

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shmrl"

# From the bottom up: a module may import from its own layer and from those listed above
# it. Names are modules under shmrl/ ("transport" is the package and every module in it).
LAYERS = {
    "base types": ["config", "presets", "spaces", "sampler", "episode", "rollout", "stats", "checkpoint", "metrics", "logdir", "dataset"],
    "protocol": ["rllink_codec", "rllink_episodes", "rllink_act_ma", "rllink_act", "rllink"],
    "transports": ["transport"],
    "model": ["onnx_graph", "net", "ppo", "onnx_policy"],
    "env adapters": ["envspec", "pz_envs", "envs"],
    "actor and simulator loops": ["actor", "multiagent", "sim", "eval"],
    "hub": ["store", "inference", "inference_ma", "recorder", "hub", "serving"],
    "launchers": ["supervisor", "ray_launcher"],
    "trainer": ["report", "resume", "pretrain", "setup_run", "adapt", "win_rate", "trainer"],
    "faces": ["run", "plot", "record", "__init__", "conformance_rules", "conformance"],
}
# The client side: what simulators and eval run, without torch (numpy and onnxruntime only).
CLIENT_MODULES = ["shmrl.actor", "shmrl.sim", "shmrl.multiagent", "shmrl.eval"]
# Never reached from the client side, even through lower layers: the learner's model code.
CLIENT_FORBIDDEN = {"shmrl.ppo", "shmrl.net"}
CLIENT_FORBIDDEN_PACKAGES = {"torch"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_name_in_the_table_is_a_module():
    """A stale entry (a module renamed or gone) would let its successor go unplaced."""
    tops = {name.removeprefix("shmrl.").split(".")[0] for name in all_modules() if name != "shmrl"} | {"__init__"}
    stale = [name for names in LAYERS.values() for name in names if name not in tops]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def layer_of(module: str) -> str | None:
    """The layer of ``shmrl.x.y``: the entry ``x.y``, else the entry ``x`` (a package)."""
    rest = "__init__" if module == "shmrl" else module.removeprefix("shmrl.")
    for layer, names in LAYERS.items():
        if rest in names or rest.split(".")[0] in names:
            return layer
    return None


def imports_of(module: str, path: Path, known: set) -> tuple[set, set]:
    """(the shmrl modules ``module`` imports, the top-level names of other packages it
    imports), from every import statement in it, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    ours, theirs = set(), set()

    def add(name: str) -> None:
        if name == "shmrl" or name.startswith("shmrl."):
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
                # ``from shmrl import rllink`` imports the module shmrl.rllink
                full = f"{base}.{alias.name}"
                add(full if full in known else base)
    # Importing shmrl.x runs shmrl/__init__ first; that is not an import of the face.
    ours.discard("shmrl")
    ours.discard(module)
    return ours, theirs


def import_graph() -> tuple[dict, dict]:
    modules = all_modules()
    known = set(modules)
    graph, external = {}, {}
    for name, path in modules.items():
        ours, theirs = imports_of(name, path, known)
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


def test_every_module_has_a_layer():
    listed = [name for names in LAYERS.values() for name in names]
    assert len(listed) == len(set(listed)), "a module is listed in two layers"
    missing = [m for m in all_modules() if layer_of(m) is None]
    assert not missing, (f"{missing}: not in any layer; place each in LAYERS at the top of {Path(__file__).name} "
                         f"(and in docs/ARCHITECTURE.md)")


def test_no_import_cycle():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_only_point_down():
    order = {layer: i for i, layer in enumerate(LAYERS)}
    graph, _ = import_graph()
    upward = [f"{m} ({layer_of(m)}) imports {n} ({layer_of(n)})"
              for m, targets in sorted(graph.items()) for n in sorted(targets)
              if layer_of(m) and layer_of(n) and order[layer_of(n)] > order[layer_of(m)]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_client_side_never_reaches_torch_or_the_learners_model():
    graph, external = import_graph()
    for start in CLIENT_MODULES:
        reached = closure(graph, start)
        assert not reached & CLIENT_FORBIDDEN, f"{start} reaches {sorted(reached & CLIENT_FORBIDDEN)}"
        packages = set().union(*(external[m] for m in reached))
        assert not packages & CLIENT_FORBIDDEN_PACKAGES, \
            f"{start} imports {sorted(packages & CLIENT_FORBIDDEN_PACKAGES)} (through {sorted(reached)})"


def test_importing_a_simulator_and_eval_loads_no_torch():
    code = ("import sys, shmrl.actor, shmrl.sim, shmrl.multiagent, shmrl.eval, shmrl.envs; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_checks_catch_what_they_look_for():
    """The checker itself: a cycle, an upward import and a relative import are seen."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph, _ = import_graph()
    assert "shmrl.rllink" in graph["shmrl.sim"]          # ``from shmrl import multiagent, rllink``
    assert "shmrl.transport" in graph["shmrl.sim"]       # a function-level import
    assert "shmrl.transport.ring" in graph["shmrl.transport.shm"]
    assert layer_of("shmrl.transport.tcp") == "transports" and layer_of("shmrl") == "faces"
