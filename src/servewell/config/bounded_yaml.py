"""YAML for configuration files, with a bound on what a small file may expand to.

`yaml.safe_load` trusts its input's shape: a 1,047-byte model.yaml of nested anchors ("billion
laughs") expanded into a structure whose validation blocked the event loop 13.2 s, peaked at
2.54 GB and wrote a 464 MB log line; lists nested 600 deep made the composer raise
RecursionError, which nothing caught. `load_bounded` composes the document itself (the C scanner
when libyaml is there, so a 1 MiB file of comments costs milliseconds) and refuses, before any
recursion or object is built, a document deeper than `max_depth`, with more than `max_aliases`
aliases, or whose nodes counted with every alias expanded exceed `max_nodes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, SequenceNode
from yaml.resolver import Resolver

try:
    from yaml.cyaml import CParser as _Parser  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - libyaml missing: the pure-Python scanner, same limits
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, Parser):  # type: ignore[no-redef]
        def __init__(self, stream: Any) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)


@dataclass(slots=True, frozen=True)
class YamlLimits:
    """How much one configuration document may hold."""

    #: Deepest nesting of lists and mappings (a model.yaml needs fewer than 10).
    max_depth: int = 32
    #: Aliases (`*name`) in the document.
    max_aliases: int = 64
    #: Nodes, every alias counted as the whole subtree it stands for.
    max_nodes: int = 50_000


class YamlLimitError(yaml.YAMLError):
    """The document is over one of the `YamlLimits` (the message says which)."""


class _BoundedComposer(Composer):
    """Composes nodes without recursion limits of its own: it counts and refuses instead."""

    limits: YamlLimits

    if TYPE_CHECKING:  # provided by the parser and resolver this is mixed with
        def check_event(self, *choices: Any) -> bool: ...
        def get_event(self) -> Any: ...
        def peek_event(self) -> Any: ...
        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any: ...

    def _start_bounds(self) -> None:
        self._depth = 0
        self._nodes = 0
        self._aliases = 0
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its expanded node count
        self._open: set[int] = set()  # anchored nodes still being composed (an alias to one is a cycle)

    def _count(self, nodes: int) -> None:
        self._nodes += nodes
        if self._nodes > self.limits.max_nodes:
            raise YamlLimitError(f"more than {self.limits.max_nodes} nodes (aliases expanded)")

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.get_event()
            self._aliases += 1
            if self._aliases > self.limits.max_aliases:
                raise YamlLimitError(f"more than {self.limits.max_aliases} aliases")
            if event.anchor not in self.anchors:
                raise yaml.composer.ComposerError(None, None, f"found undefined alias {event.anchor!r}",
                                                  event.start_mark)
            target: Node = self.anchors[event.anchor]
            if id(target) in self._open:
                raise YamlLimitError(f"alias {str(event.anchor)[:40]!r} refers to a node that contains it")
            self._count(self._sizes.get(id(target), 1))
            return target
        event = self.peek_event()
        anchor = event.anchor
        if anchor is not None and anchor in self.anchors:
            raise yaml.composer.ComposerError("found duplicate anchor", self.anchors[anchor].start_mark,
                                              "second occurrence", event.start_mark)
        before = self._nodes
        self._count(1)
        if self.check_event(ScalarEvent):
            node: Node = self.compose_scalar_node(anchor)
        else:
            self._depth += 1
            if self._depth > self.limits.max_depth:
                raise YamlLimitError(f"nested deeper than {self.limits.max_depth} levels")
            if self.check_event(SequenceStartEvent):
                node = self._compose_collection(anchor, sequence=True)
            elif self.check_event(MappingStartEvent):
                node = self._compose_collection(anchor, sequence=False)
            else:  # pragma: no cover - the parser yields nothing else here
                raise yaml.composer.ComposerError(None, None, "unexpected event", event.start_mark)
            self._depth -= 1
        if anchor is not None:
            self._sizes[id(node)] = self._nodes - before
        return node

    def _compose_collection(self, anchor: str | None, sequence: bool) -> Node:
        # As Composer.compose_sequence_node / compose_mapping_node, but the anchor is registered
        # as "open" so that an alias to an enclosing node (a cycle) is refused.
        start = self.get_event()
        tag = start.tag
        if tag is None or tag == "!":
            kind = SequenceNode if sequence else MappingNode
            tag = self.resolve(kind, None, start.implicit)
        node: SequenceNode | MappingNode
        if sequence:
            node = SequenceNode(tag, [], start.start_mark, None, flow_style=start.flow_style)
        else:
            node = MappingNode(tag, [], start.start_mark, None, flow_style=start.flow_style)
        if anchor is not None:
            self.anchors[anchor] = node
            self._open.add(id(node))
        if sequence:
            index = 0
            while not self.check_event(yaml.events.SequenceEndEvent):
                node.value.append(self.compose_node(node, index))
                index += 1
        else:
            while not self.check_event(yaml.events.MappingEndEvent):
                key = self.compose_node(node, None)
                node.value.append((key, self.compose_node(node, key)))
        node.end_mark = self.get_event().end_mark
        self._open.discard(id(node))
        return node



class _BoundedLoader(_BoundedComposer, _Parser, SafeConstructor, Resolver):
    def __init__(self, stream: Any, limits: YamlLimits) -> None:
        _Parser.__init__(self, stream)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self.limits = limits
        self._start_bounds()


def load_bounded(text: str | bytes, limits: YamlLimits | None = None) -> Any:
    """The one YAML document in `text`, built with the safe constructor; `YamlLimitError` when it
    is over `limits`, another `yaml.YAMLError` when it is not valid YAML."""
    loader = _BoundedLoader(text, limits or YamlLimits())
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def short_yaml_error(exc: yaml.YAMLError, limit: int = 300) -> str:
    """A YAML error as one bounded line (a problem mark can quote a line of a megabyte)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        where = f" (line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1})" \
            if exc.problem_mark is not None else ""
        text = f"{exc.context or ''} {exc.problem or ''}".strip() + where
    else:
        text = str(exc)
    return cut(" ".join(text.split()), limit)


def cut(text: str, limit: int = 300) -> str:
    """`text` no longer than `limit` characters (an ellipsis and the count dropped when cut)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
