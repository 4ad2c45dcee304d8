"""``yaml.safe_load`` with the three refusals a config file needs, each raised as :class:`YAMLRefusal` with its line.

``safe_load`` never runs code, but it accepts documents that are always a mistake in a config, or that turn a small
file into a crash later:

- **a key given twice in one mapping** (``steps: 2`` and further down ``steps: 5000``): YAML keeps the last one
  silently, so the run does something the reader of the file does not expect. Keys brought in by a merge (``<<:``)
  may still be overridden; that is what merging is for.
- **nesting deeper than** :data:`MAX_DEPTH`: PyYAML's composer recurses once per level, so a few thousand ``[`` end
  in a ``RecursionError``. The composer is stopped at the limit, and nesting built through aliases (each anchor one
  level deeper than the last) is measured too, since every later step walks the expanded value.
- **aliases that expand to more than** :data:`MAX_VALUES` values or **into themselves** (``&a [*a]``): the loaded
  value shares its pieces, but checking and copying it visits every use, which takes forever or never ends;
- **an integer longer than Python converts** (``sys.get_int_max_str_digits()``, 4300 digits): ``safe_load`` lets
  that ``ValueError`` escape.

Everything else -- tags, merges, types -- is ``safe_load``'s own behaviour: the loader is a subclass of
:class:`yaml.SafeLoader` that only adds checks.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

#: Deepest nesting of mappings and lists in a config (a recipe uses four or five levels).
MAX_DEPTH = 100
#: Most values (mappings, lists and scalars, counted at every use of an alias) one document may expand to.
MAX_VALUES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLRefusal(Exception):
    """A document ``safe_load`` would read but a config must not hold; ``line`` is 1-based (``None``: unknown)."""

    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line


def load(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing duplicate keys, deep nesting and runaway aliases (:class:`YAMLRefusal`);
    malformed YAML still raises :class:`yaml.YAMLError`."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass


def _line(node_or_mark: Any) -> int | None:
    mark = getattr(node_or_mark, "start_mark", node_or_mark)
    return mark.line + 1 if mark is not None else None


class _StrictLoader(yaml.SafeLoader):
    """:class:`yaml.SafeLoader` plus the checks of the module docstring, made on the composed node graph before any
    value is constructed."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YAMLRefusal(f"nested deeper than {MAX_DEPTH} levels", _line(self.peek_event()))
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node: Node) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than int() converts
            raise YAMLRefusal(f"the integer {node.value[:12]}... has more digits than can be read "
                              f"({len(node.value)})", _line(node)) from None

    def construct_document(self, node: Node) -> Any:
        self._check_graph(node)
        return super().construct_document(node)

    def _check_graph(self, root: Node) -> None:
        """One pass over the node graph (iterative: alias chains may be deep): duplicate keys with their key path,
        depth and expanded size through aliases (memoised per node, so shared pieces are measured once), cycles."""
        measured: dict[int, tuple[int, int]] = {}  # id(node) -> (depth, values) of its expanded value
        open_nodes: set[int] = set()  # nodes whose children are being measured: meeting one again is a cycle
        stack: list[tuple[Node, str, bool]] = [(root, "", False)]
        while stack:
            node, path, children_done = stack.pop()
            key = id(node)
            children = _children(node, path)
            if children_done:
                open_nodes.discard(key)
                depth = 1 + max((measured[id(child)][0] for child, _ in children), default=0)
                values = 1 + sum(measured[id(child)][1] for child, _ in children)
                if depth > MAX_DEPTH:
                    raise YAMLRefusal(f"'{path or '<top>'}' expands (through aliases) to more than {MAX_DEPTH} levels "
                                      "of nesting", _line(node))
                if values > MAX_VALUES:
                    raise YAMLRefusal(f"'{path or '<top>'}' expands (through aliases) to more than {MAX_VALUES} "
                                      "values", _line(node))
                measured[key] = (depth, values)
                continue
            if key in measured:
                continue
            if key in open_nodes:
                raise YAMLRefusal(f"'{path or '<top>'}' contains itself (a recursive alias)", _line(node))
            if isinstance(node, MappingNode):
                self._check_keys(node, path)
            open_nodes.add(key)
            stack.append((node, path, True))
            stack.extend((child, child_path, False) for child, child_path in reversed(children))

    def _check_keys(self, node: MappingNode, path: str) -> None:
        first_line: dict[Any, int | None] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or isinstance(key_node, (MappingNode, SequenceNode)):
                continue  # merged keys may be overridden; a collection key is refused by safe_load itself
            key = self.construct_object(key_node)
            if key in first_line:
                dotted = f"{path}.{key}" if path else str(key)
                raise YAMLRefusal(f"duplicate key '{dotted}' (first given on line {first_line[key]}); YAML would "
                                  "silently keep only the last value", _line(key_node))
            first_line[key] = _line(key_node)


def _children(node: Node, path: str) -> list[tuple[Node, str]]:
    """The nodes directly inside ``node``, each with the key path shown in messages."""
    if isinstance(node, SequenceNode):
        return [(child, f"{path}[{i}]") for i, child in enumerate(node.value)]
    if isinstance(node, MappingNode):
        found = []
        for key_node, value_node in node.value:
            name = key_node.value if isinstance(key_node.value, str) else "<key>"
            found += [(key_node, path), (value_node, f"{path}.{name}" if path else name)]
        return found
    return []


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)
