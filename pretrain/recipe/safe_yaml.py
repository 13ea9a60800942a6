"""YAML as pretrain reads it (recipes, overrides, accelerate configs): ``yaml.SafeLoader`` and four refusals.

PyYAML's safe_load builds no objects, but it silently keeps the last of two equal keys (a recipe that sets
``optim.lr`` twice trains with the second), expands aliases without bound (a few lines of "billion laughs"
become gigabytes once something walks or prints them), follows a recursive alias into a self-containing
mapping, and reads a 400-digit integer as a Python int that overflows the first C library it reaches. Each
is one ``ConfigError`` naming the file (or override), the line and the fix, before anything uses the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pretrain.errors import ConfigError

# A recipe is a few hundred nodes; aliases may reuse a block, never multiply it into this many.
MAX_EXPANDED_NODES = 100_000
# A recipe or accelerate config is a few KB; refusing a large file keeps memory bounded before parsing.
MAX_FILE_BYTES = 4 * 2**20
INT64_MAX = 2**63 - 1
_MERGE_TAG = "tag:yaml.org,2002:merge"


class Refused(yaml.YAMLError):
    """Valid YAML that pretrain will not read (duplicate key, alias bomb, recursive alias, huge integer)."""

    def __init__(self, problem: str, mark: yaml.Mark | None = None):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


def _where(mark: yaml.Mark | None) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, alias expansion beyond MAX_EXPANDED_NODES, recursive aliases and
    integers beyond 64 bits."""

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple[str, str], yaml.Mark] = {}
        for key_node, _ in node.value:
            # `<<: *defaults` merges are YAML's own override mechanism; a later explicit key may override them.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                first = seen[key]
                raise Refused(f"duplicate key {key_node.value!r} (first at line {first.line + 1}): YAML keeps only "
                              "the last, so one of the two values would be silently ignored; keep one",
                              key_node.start_mark)
            seen[key] = key_node.start_mark
        return node

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_yaml_int(self, node):
        value = super().construct_yaml_int(node)
        if abs(value) > INT64_MAX:
            digits = len(str(abs(value)))
            raise Refused(f"the integer {node.value[:12]}... ({digits} digits) is beyond a 64-bit integer "
                          f"(at most {INT64_MAX:,}); give a smaller number", node.start_mark)
        return value


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)


def _check_expansion(root: yaml.Node | None) -> None:
    """Count the nodes the document expands to (an alias counts its target's nodes again), without expanding it:
    one pass over the node graph, each node's size computed once. A node reached again while its own size is
    being computed is a recursive alias."""
    if root is None:
        return
    sizes: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # iterative: a deeply nested document must not exhaust Python's recursion limit here
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            active.discard(id(node))
            size = 1 + sum(sizes[id(child)] for child in children)
            if size > MAX_EXPANDED_NODES:
                raise Refused(f"aliases expand this document to more than {MAX_EXPANDED_NODES:,} values (an alias "
                              "bomb?); write the values out, or use fewer nested aliases", node.start_mark)
            sizes[id(node)] = size
            continue
        if id(node) in active:
            raise Refused("a recursive alias (a mapping or list that contains itself); pretrain reads finite "
                          "documents only: remove the alias", node.start_mark)
        active.add(id(node))
        stack.append((node, True))
        for child in children:
            if id(child) in active:
                raise Refused("a recursive alias (a mapping or list that contains itself); pretrain reads finite "
                              "documents only: remove the alias", child.start_mark)
            stack.append((child, False))


def loads(text: str, source: str, or_text: bool = False) -> Any:
    """Parse one YAML document; any problem is one ConfigError naming ``source`` and the line. ``or_text``:
    text that is not YAML at all is returned as it is (an override's value), a refused document still raises."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (StrictLoader is a SafeLoader)
    except Refused as exc:
        raise ConfigError(f"{source}{_where(exc.problem_mark)}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        if or_text:
            return text
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML in {source}{_where(mark)}: {problem}; fix the syntax there") from None
    except RecursionError:
        raise ConfigError(f"{source} is nested too deeply to read; a recipe is a few levels of mappings") from None


def read(path: Path, what: str) -> Any:
    """Read and parse a YAML file (``what``: "recipe", "accelerate config"): bounded size, UTF-8 (a BOM is
    accepted), one ConfigError for anything else. The caller checks the file exists."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{what} {path} is {size / 2**20:.1f} MiB; a {what} is a few KB of YAML: is this the "
                              "right file?")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
                          "save it as UTF-8") from None
    return loads(text, f"{what} {path}")
