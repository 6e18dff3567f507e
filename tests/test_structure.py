"""The package structure: the import graph of kdtree/ (every `import kdtree...`, at the top of a module AND inside
functions) has no cycle and none of the forbidden package edges, and the pipeline layer names no stage.

Package cycles: the graph whose nodes are packages (kdtree/config, kdtree/checkpoint, ...; a top-level module such
as kdtree/engine.py is a node of its own, the kdtree package's __init__ too) with an edge A -> B when a module of A
imports one of B has no cycle either: modules can be acyclic while their packages are not (config.validate ->
checkpoint.tiny -> config.paths), and such a pair cannot be split or layered. A package cycle that is structural
goes in PACKAGE_CYCLE_EXCEPTIONS with its reason."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

KDTREE = Path(__file__).resolve().parents[1] / "kdtree"

# (importing package, imported package): the layering rules
FORBIDDEN = [("pipeline", p) for p in ("serve", "engine", "model", "decode", "backends", "checkpoint", "stages")] + [
    ("backends", "decode"),
    ("quant", "checkpoint"),    # checkpoint -> quant (the loader builds Int4Weight), never back
    ("config", "backends"),
]


def _modules() -> Dict[str, Path]:
    out = {}
    for p in KDTREE.rglob("*.py"):
        parts = list(p.relative_to(KDTREE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The kdtree modules `module` imports anywhere in its file (a name imported from a package counts as the
    submodule when it is one, else as the package)."""
    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(resolve(a.name) for a in node.names if a.name.split(".")[0] == "kdtree")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kdtree":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in modules else resolve(base))
    out.discard("")
    out.discard(module)
    return out


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    """kdtree.pipeline.runner -> pipeline; kdtree.engine -> engine (a top-level module is its own package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


# sorted package names of a cycle -> why it is allowed; keep it empty
PACKAGE_CYCLE_EXCEPTIONS: Dict[Tuple[str, ...], str] = {
    # the native target/drafter (backends/native_forward.py, native_drafter.py) implement model/'s Target protocol
    # from the weights and model/derived.py, and model/target.py's factory picks them; the fix is to move the two
    # native forwards into model/ (next step, not done in issue 32)
    ("backends", "model"): "native forwards implement model's Target protocol; model/target.py picks them",
}


def _package_graph(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {}
    for pa, pb, _, _ in _package_edges(graph):
        out.setdefault(pa, set()).add(pb)
    return out


def _package_edges(graph) -> Set[Tuple[str, str, str, str]]:
    return {(_package(a), _package(b), a, b) for a, bs in graph.items() for b in bs if _package(a) != _package(b)}


def test_the_graph_is_read_from_top_level_and_function_level_imports():
    g = _graph()
    assert "kdtree.pipeline.registry" in g["kdtree.pipeline.spec"]       # top level
    assert "kdtree.train.loop" in g["kdtree.stages.train_tiny"]          # inside run() (torch is optional)


def test_no_import_cycle_in_kdtree():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_package_cycle_in_kdtree():
    g = _graph()
    found = [c for c in _cycles(_package_graph(g)) if tuple(c) not in PACKAGE_CYCLE_EXCEPTIONS]
    edges = sorted(f"{a} -> {b}" for pa, pb, a, b in _package_edges(g) if any({pa, pb} <= set(c) for c in found))
    assert found == [], f"package cycle(s) {found}; the module imports that make them: {edges}"


def test_the_package_cycle_finder_finds_a_planted_one():
    g = {"kdtree.config.validate": {"kdtree.checkpoint.tiny"}, "kdtree.checkpoint.tiny": {"kdtree.config.paths"},
         "kdtree.config.paths": set(), "kdtree.stages.plan": {"kdtree.config.paths", "kdtree.checkpoint.tiny"}}
    assert _cycles(g) == []                                  # no module cycle ...
    assert _cycles(_package_graph(g)) == [["checkpoint", "config"]]   # ... but a package one


@pytest.mark.parametrize("src,dst", FORBIDDEN, ids=[f"{a}->{b}" for a, b in FORBIDDEN])
def test_forbidden_package_edge(src, dst):
    bad = sorted(f"{a} -> {b}" for pa, pb, a, b in _package_edges(_graph()) if (pa, pb) == (src, dst))
    assert bad == [], f"{src} must not import {dst}"


def test_pipeline_layer_names_no_stage():
    """The runner, the engine process and the registry know stages only through their declarations."""
    stages = {p.stem for p in (KDTREE / "stages").glob("*.py") if not p.stem.startswith("_")}
    named = []
    for path in sorted((KDTREE / "pipeline").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in stages:
                named.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert named == []


# the decode round's decisions: who may call them (the op implementations in backends/ and tree.py aside)
DECISIONS = ("tree_accept", "sampled_walk", "commit_tokens")
DECIDER = "kdtree/decode/state.py"


def _calls(path: Path, names) -> List[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in names:
                where = path.relative_to(KDTREE.parent) if path.is_relative_to(KDTREE.parent) else path
                out.append(f"{where}:{node.lineno}: {name}")
    return out


def test_tokens_are_decided_in_one_decode_module():
    """Tree accept, the sampled walk and the stop rule are called from kdtree/decode/state.py (DecodeState) only:
    there is one decode round, alone or batched (the backends implement the accept op, they do not decide)."""
    calls = [c for p in sorted(KDTREE.rglob("*.py")) if "backends" not in p.parts and p.name != "tree.py"
             for c in _calls(p, DECISIONS)]
    assert calls and all(c.startswith(DECIDER + ":") for c in calls), calls
    assert {c.rsplit(": ", 1)[1] for c in calls} == set(DECISIONS)


def test_the_decision_finder_sees_a_second_decoder(tmp_path):
    loop = tmp_path / "my_loop.py"
    loop.write_text("def run(res, ops, t):\n    path, bonus = ops.tree_accept(*t)\n    commit_tokens(res, path, 4, None, ())\n")
    assert [c.rsplit(": ", 1)[1] for c in _calls(loop, DECISIONS)] == ["tree_accept", "commit_tokens"]


# Files over ~500 lines, each with the reason it stays one file. A new long file fails until it is split or named
# here; a named one that shrank below the limit fails too (the list stays true).
LONG_FILE_LINES = 520
LONG_FILES = {
    "kdtree/backends/native.py": "the whole cffi binding of native/include/kdtree.h: one checked wrapper per kernel "
                                 "of the ABI, so a kernel's Python side sits next to the others it must agree with",
    "kdtree/checkpoint/loader.py": "one read plan (validate against names.py, choose mmap / parallel reads / TP "
                                   "slices, widen or keep dtypes) whose stages share the plan's state",
}
LONG_FUNCTION_LINES = 80
SHORT_FUNCTION_PACKAGES = ("decode", "serve")


def _lines(path: Path) -> int:
    return path.read_text().count("\n")


def test_no_long_file_without_a_stated_reason():
    long = {str(p.relative_to(KDTREE.parent)): _lines(p) for p in KDTREE.rglob("*.py") if _lines(p) > LONG_FILE_LINES}
    unnamed = {p: n for p, n in long.items() if p not in LONG_FILES}
    assert not unnamed, f"files over {LONG_FILE_LINES} lines: split them or state why in LONG_FILES: {unnamed}"
    stale = [p for p in LONG_FILES if p not in long]
    assert not stale, f"LONG_FILES names files that are no longer long (or gone): {stale}"


def long_functions(root: Path, packages=SHORT_FUNCTION_PACKAGES, limit: int = LONG_FUNCTION_LINES) -> List[str]:
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_long_function_in_decode_and_serve():
    assert long_functions(KDTREE) == []


def test_the_long_function_finder_sees_one(tmp_path):
    pkg = tmp_path / "kdtree" / "decode"
    pkg.mkdir(parents=True)
    (pkg / "loop.py").write_text("def f():\n" + "    x = 1\n" * 90)
    (tmp_path / "kdtree" / "serve").mkdir()
    assert long_functions(tmp_path / "kdtree") == ["kdtree/decode/loop.py:1 f (91 lines)"]
