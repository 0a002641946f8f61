"""The import rules of docs/ARCHITECTURE.md, read from the source (function-level imports included):
no cycle between packages, the engine directory is the only thing building and serving share, and
the shared modules import none of the packages above them."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "trtserve"
# what every package may import
SHARED = {"errors", "fileio", "graph_files", "graph_index", "memory", "progress", "settings", "engine_dir", "data"}
ALLOWED = {  # package -> the packages (beyond SHARED) it may import
    "models": set(),
    "runtime": {"models"},
    "precision": {"models", "runtime"},
    "engine_builder": {"models", "runtime", "precision"},
    "eval": {"models", "runtime", "precision", "engine_builder"},
    "server": {"models", "runtime"},
    "deploy": {"models", "runtime", "engine_builder", "server"},
    "research": {"models", "runtime", "engine_builder"},
    "testing": set(),
}


def _package(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imported(path: Path, tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's own package
                base = list(path.relative_to(ROOT).parts[:-1])[: len(path.relative_to(ROOT).parts) - node.level]
                names = [".".join(["trtserve", *base, *([node.module] if node.module else [])])]
            else:
                names = [node.module or ""]
                if node.module == "trtserve":  # from trtserve import engine_dir
                    names = [f"trtserve.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("trtserve."):
                yield name.split(".")[1], node.lineno


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> where ("file:line")."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        source = _package(path)
        for target, line in _imported(path, ast.parse(path.read_text(), str(path))):
            if target != source and target != "__version__":
                graph[source][target].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def _cycle(graph) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in graph.get(node, {}):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
            if nxt not in state and (found := visit(nxt, trail + [nxt])):
                return found
        state[node] = 2
        return None

    for start in list(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, dict[str, str]]:
    """module -> imported trtserve module -> where ("file:line"), function-level imports included;
    `from package import name` counts as importing the module `package.name` where there is one."""
    files = {_module_name(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module
                         for alias in node.names]
            else:
                continue
            for name in names:
                if name in files and name != module:
                    graph[module].setdefault(name, f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return graph


def test_no_import_cycle_between_modules():
    graph = module_graph()
    assert "trtserve.server.http" in graph["trtserve.server.kserve"]  # read from the source, imports in functions too
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:]))


def test_the_graph_is_read_from_every_import():
    graph = package_graph()
    # function-level imports count: the server opens engines through engine_dir inside functions
    assert any(where for where in graph["server"].get("engine_dir", [])), dict(graph["server"])
    assert {"runtime", "engine_builder", "server"} <= set(graph)


def test_no_import_cycle_between_packages():
    graph = package_graph()
    cycle = _cycle({k: dict(v) for k, v in graph.items()})
    assert cycle is None, " -> ".join(cycle) + ": " + "; ".join(
        f"{a} -> {b} at {graph[a][b][0]}" for a, b in zip(cycle, cycle[1:]))


def test_each_package_imports_only_what_its_layer_allows():
    graph = package_graph()
    wrong = []
    for source, targets in graph.items():
        if source in SHARED:
            allowed = SHARED
        elif source in ALLOWED:
            allowed = SHARED | ALLOWED[source]
        else:  # the entry points (cli, doctor, __main__) may use everything
            continue
        wrong += [f"{source} -> {target} at {', '.join(where)}" for target, where in targets.items()
                  if target not in allowed]
    assert not wrong, "\n".join(wrong)


def test_runtime_and_server_never_import_the_builder():
    graph = package_graph()
    for package in ("runtime", "server"):
        assert not {"engine_builder", "precision", "eval"} & set(graph[package]), dict(graph[package])


def test_a_cycle_is_found_and_named():
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "d": {"c": 1}}) is None


PRECISION_PUBLIC = {"policy", "measure", "run", "fidelity", "probe", "probe_report", "write"}  # the rest is strategy


def test_only_precision_imports_its_strategy_modules():
    outside = {m: targets for m, targets in module_graph().items() if not m.startswith("trtserve.precision")}
    wrong = [f"{m} -> {t} at {where}" for m, targets in outside.items() for t, where in targets.items()
             if t.startswith("trtserve.precision.") and t.split(".")[2] not in PRECISION_PUBLIC]
    assert not wrong, "\n".join(wrong)


def test_the_builder_never_branches_on_a_precision():
    """engine_builder/ compares no value with a precision's or a weight format's name: what differs between
    policies is precision/'s business (precision.write)."""
    from trtserve.precision.policy import POLICIES

    names = set(POLICIES) | {p.weights for p in POLICIES.values()}
    branches = []
    for path in sorted((ROOT / "engine_builder").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                values = [node.left, *node.comparators]
                values += [e for v in values if isinstance(v, (ast.Tuple, ast.List, ast.Set)) for e in v.elts]
                about = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                         if isinstance(n, (ast.Name, ast.Attribute))}  # cfg.backend == "auto" is not a policy
                if about & {"precision", "policy", "weights"} and any(
                        isinstance(v, ast.Constant) and v.value in names for v in values):
                    branches.append(f"{path.name}:{node.lineno}")
    assert not branches, branches
