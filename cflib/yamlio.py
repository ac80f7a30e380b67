"""YAML read safely and with bounds, with errors that name the file and the kind of document it was meant to be.

Only YAML's plain data is built (PyYAML's safe loader: no object of any
class). Before anything is built, the document's size, its nesting and the
number of nodes it stands for once its aliases are expanded are bounded: a
few hundred bytes of aliases of aliases (a "billion laughs") would otherwise
expand to more than any caller can walk, print or hold.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cflib.errors import shown
from cflib.jsonio import read_bounded

MAX_BYTES = 4 * 2**20  # a parameter, curriculum, plan, spec or template file
MAX_DEPTH = 64  # sequences and mappings inside each other, aliases expanded
MAX_NODES = 100_000  # scalars, sequences and mappings, every alias counted as the nodes it stands for


def _expanded(root: yaml.Node, where: str, error: type[Exception]) -> None:
    """`error` unless the node graph, aliases expanded, has at most MAX_NODES nodes, MAX_DEPTH levels and no
    cycle. Each distinct node is visited once (its expanded size and depth memoised), so the cost is the
    document's size, not the size it expands to."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in children)
            depth[key] = 1 + max((depth[id(child)] for child in children), default=0)
            if size[key] > MAX_NODES:
                raise error(f"{where}: the YAML stands for more than {MAX_NODES:,} values once its aliases (*name) "
                            "are expanded; write the values out, or use fewer aliases of aliases")
            if depth[key] > MAX_DEPTH:
                raise error(f"{where}: YAML nested deeper than {MAX_DEPTH} levels (aliases expanded)")
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise error(f"{where}: a YAML alias (*name) refers to a node that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _nesting(text: str, where: str, error: type[Exception]) -> None:
    """`error` when the text nests collections deeper than MAX_DEPTH (read as events, without recursion: the
    composer that builds nodes recurses once per level)."""
    level = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            level += 1
            if level > MAX_DEPTH:
                raise error(f"{where}: YAML nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            level -= 1


class _Loader(yaml.SafeLoader):
    """The safe loader, whose value constructors' own errors become YAML errors at the value's line: a date
    such as 2001-13-45, an int past Python's 4,300 digits or `!!timestamp "x"` raise ValueError or
    AttributeError from inside PyYAML, which would escape as a traceback naming no file."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, AttributeError, OverflowError) as err:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {shown(node.value)} as {node.tag} ({err})", node.start_mark) from None


def load_yaml(text: str, where: str, error: type[Exception]) -> Any:
    """The plain data of one YAML document, bounded, or `error` naming `where`."""
    if len(text) > MAX_BYTES:
        raise error(f"{where}: {len(text):,} characters of YAML, more than the {MAX_BYTES:,} cflib reads")
    try:
        _nesting(text, where, error)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _expanded(node, where, error)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise error(f"{where}: not valid YAML ({err})") from None


def read_yaml(path: str | Path, error: type[Exception], what: str) -> Any:
    """A YAML document (safe loader, bounded), or `error` naming the file."""
    data = read_bounded(path, MAX_BYTES, error, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: not valid YAML ({err})") from None
    return load_yaml(text, str(path), error)
