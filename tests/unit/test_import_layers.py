"""Lint-as-test: the library's folders are layers (issue #31 item 4; docs/design.md, "The folders as layers").

A module imports, at the top or deferred inside a function, only its own package and the packages below it in
``LAYERS``; and no two modules import each other through any path (a cycle). A package's ``__main__.py`` is a command
(``python -m megatron_gkd.teacher.cache build``): an entry point, it may import any layer. The arrows and cycles that exist today
and wait for their move are listed in ``KNOWN_UPWARD`` and ``KNOWN_CYCLES``, each with the move that removes it: the
lint fails on a new one, and on a listed one that is gone (so that the list only shrinks).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top. The top-level folders parallel/ and models/ install as megatron_gkd.parallel and megatron_gkd.models.
LAYERS = (
    "registry", "log_setup", "child_process", "platform",  # leaves: no project imports
    "parallel", "planning", "models",  # process groups, parameter and memory counts, Megatron <-> HF models
    "data", "losses", "weight_sync", "rollout", "rewards", "xtok", "teacher",  # the subsystems
    "config",  # the run's config: composes the subsystems' sections and checks them together
    "trainer", "launcher", "prune",  # the run, and the jobs beside it that build models under a layout
    "recipes", "testing",  # assets and test helpers built on everything
)
KNOWN_UPWARD: dict[tuple[str, str], str] = {
    # (importing module, imported package): the move that removes it
}
KNOWN_CYCLES: dict[frozenset, str] = {}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder in ("megatron_gkd", "parallel", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] != "megatron_gkd":
                parts.insert(0, "megatron_gkd")
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The project's modules that ``name`` imports (a ``from package import module`` counts as the module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("megatron_gkd.") and target != name:
                found.add(target)
    return found


def _layer(module: str) -> str:
    return module.split(".")[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_library_package_has_a_layer():
    unplaced = {_layer(name) for name in _graph() if "." in name} - set(LAYERS)
    assert not unplaced, f"place these packages in LAYERS (bottom to top): {sorted(unplaced)}"


def test_no_package_imports_one_above_it():
    rank = {layer: index for index, layer in enumerate(LAYERS)}
    upward = {(name, _layer(target)) for name, targets in _graph().items() if "." in name
              and not name.endswith(".__main__") for target in targets if rank[_layer(target)] > rank[_layer(name)]}
    new = sorted(upward - KNOWN_UPWARD.keys())
    assert not new, ("these modules import a package above their own (see LAYERS): move the code to the layer it "
                     f"belongs to, or the import's target down: {new}")
    gone = sorted(KNOWN_UPWARD.keys() - upward)
    assert not gone, f"these listed upward imports are gone: remove them from KNOWN_UPWARD: {gone}"


def _cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_cycles():
    cycles = set(_cycles(_graph()))
    new = [sorted(cycle) for cycle in cycles - KNOWN_CYCLES.keys()]
    assert not new, f"these modules import one another (through any path, deferred imports included): {new}"
    gone = [sorted(cycle) for cycle in KNOWN_CYCLES.keys() - cycles]
    assert not gone, f"these listed cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_the_cycle_finder_finds_a_cycle_and_the_layer_check_an_upward_arrow():
    graph = {"megatron_gkd.a.x": {"megatron_gkd.b.y"}, "megatron_gkd.b.y": {"megatron_gkd.b.z"},
             "megatron_gkd.b.z": {"megatron_gkd.a.x"}, "megatron_gkd.c.w": set()}
    assert _cycles(graph) == [frozenset({"megatron_gkd.a.x", "megatron_gkd.b.y", "megatron_gkd.b.z"})]
    assert _cycles({"megatron_gkd.a.x": {"megatron_gkd.b.y"}, "megatron_gkd.b.y": set()}) == []
