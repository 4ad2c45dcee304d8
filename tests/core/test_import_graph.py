"""No import cycle between the parts of ``loongforge``: its subpackages (checkpoint, config, data, devices, ...) and
its top-level modules (plugins, registry, cli, ...).

Every import counts -- module level, inside functions, ``TYPE_CHECKING`` blocks excepted (they never run) -- because
a function-local import is still a dependency: it only hides the cycle until the function runs. Parts form layers
when the graph is acyclic; a failure lists each cycle's edges as ``file:line``, so the smallest move that breaks it
(the shared piece into the lower layer) can be chosen.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import loongforge

ROOT = Path(loongforge.__file__).resolve().parent
PACKAGE = "loongforge"


def _part(module: str) -> str | None:
    """``loongforge.devices.cpu`` -> ``devices``; ``loongforge.plugins`` -> ``plugins``; outside -> None."""
    names = module.split(".")
    if names[0] != PACKAGE or len(names) < 2:
        return None
    return names[1]


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT.parent).with_suffix("")
    names = list(relative.parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(path: Path) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import in ``path``; ``from x import y`` counts ``x.y`` when ``y`` is
    a module, else ``x``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skipped = _type_checking_lines(tree)
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (ROOT.parent / Path(*candidate.split("."))).with_suffix(".py").is_file() or (
                    ROOT.parent / Path(*candidate.split(".")) / "__init__.py").is_file()
                found.append((candidate if is_module else base, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> ``file:line`` of each import that makes the edge."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        source = _part(_module_name(path))
        for imported, line in _imports(path):
            target = _part(imported)
            if source and target and target != source:
                graph[source][target].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one part (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, {}):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def shortest_cycle(graph: dict[str, dict[str, list[str]]], start: str, members: set[str]) -> list[str]:
    """The shortest path ``start -> ... -> start`` inside ``members`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph.get(node, {})):
                if successor not in members or successor in came_from:
                    continue
                came_from[successor] = node
                if successor == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                following.append(successor)
        frontier = following
    return []


def describe(graph: dict[str, dict[str, list[str]]], component: list[str]) -> str:
    """One shortest cycle through each part of the component, each edge with the imports (file:line) that make it."""
    members, seen, lines = set(component), set(), []
    for part in component:
        cycle = shortest_cycle(graph, part, members)
        edges = list(zip(cycle, cycle[1:], strict=False))
        if frozenset(edges) in seen:
            continue
        seen.add(frozenset(edges))
        lines.append("  " + " -> ".join(cycle))
        lines += [f"    {a} -> {b}: {', '.join(sorted(set(graph[a][b])))}" for a, b in edges]
    return f"parts {', '.join(component)} import each other:\n" + "\n".join(lines)


def test_the_graph_sees_function_local_and_from_imports():
    graph = import_graph()
    # builtin.py imports loongforge.models.registration inside a hook function, and cli.py `from loongforge
    # import __version__` style names resolve to the package's modules.
    assert any(edge.startswith("loongforge/builtin.py:") for edge in graph["builtin"]["models"])
    assert "plugins" in graph["cli"] and "commands" in graph["plugins"]
    assert graph["checkpoint"]["errors"] and "parallel" in graph["interop"]  # world.py, inside a function


def test_no_import_cycle_between_subpackages():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (edges as file:line):\n" + "\n".join(describe(graph, c) for c in found)
