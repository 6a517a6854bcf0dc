"""Load a spec: safe YAML with a location for every node, `extends`, then command-line overrides.

The YAML is composed into nodes by PyYAML's SafeLoader (so Python object tags are refused, never
executed) and turned into plain data by a walker that records where every key and item stood,
refuses duplicate keys, and enforces size, node and depth limits before anything is built.

Plain scalars resolve by the YAML 1.2 core schema, not PyYAML's YAML 1.1 default: `yes`/`no`/`on`/`off`
stay strings, `1:30` is not the sexagesimal 90, `010` is ten, not octal 8, and `2001-12-14` is text, so
that a careless value is refused by the schema instead of silently becoming another number.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from composer.errors import Diagnostic, Location, SpecError

MAX_FILE_BYTES = 1 << 20  # 1 MiB: specs are small; anything larger is a mistake or an attack
MAX_NODES = 10_000  # after alias expansion: stops "billion laughs" alias bombs (a spec has a few hundred)
MERGE_TAG = "tag:yaml.org,2002:merge"
MAX_DEPTH = 64


class SpecLoader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's implicit types (bool, int, float, null) and merge keys."""


SpecLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    ("float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
     "-+0123456789."),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("merge", r"^(?:<<)$", "<"),
):
    SpecLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))


MAX_INT_DIGITS = 30  # far beyond any setting (int64 has 19 digits); longer ones cost time to even convert


class _ValueError(yaml.constructor.ConstructorError):
    """A plain value the spec cannot hold, with the hint to show."""

    def __init__(self, problem: str, mark, hint: str):
        super().__init__(None, None, problem, mark)
        self.hint = hint


def _construct_int(loader, node) -> int:
    """Decimal (leading zeros allowed, still decimal), 0o octal or 0x hex: no YAML 1.1 octal or base 60."""
    text = loader.construct_scalar(node)
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    if len(digits) > MAX_INT_DIGITS:
        raise _ValueError(f"an integer with {len(digits)} digits", node.start_mark,
                          "no setting takes a number this large; quote it if it is meant as text")
    base = 8 if digits.startswith("0o") else 16 if digits.startswith("0x") else 10
    return sign * int(digits[2:] if base != 10 else digits, base)


SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


@dataclass
class LoadedSpec:
    data: dict
    positions: dict = field(default_factory=dict)  # path tuple -> Location
    file: str = "<spec>"

    def locate(self, path) -> Location | None:
        path = tuple(path)
        while True:
            if path in self.positions:
                return self.positions[path]
            if not path:
                return None
            path = path[:-1]


def _err(message: str, file: str, mark=None, path=(), hint="") -> SpecError:
    loc = Location(file, mark.line + 1, mark.column + 1) if mark is not None else Location(file, 1, 1)
    return SpecError([Diagnostic("yaml", message, tuple(path), loc, hint)])


class _Walker:
    """Turns a composed node tree into plain data plus a path -> Location map."""

    def __init__(self, loader: SpecLoader, file: str):
        self.loader = loader
        self.file = file
        self.count = 0
        self.positions: dict = {}

    def loc(self, node) -> Location:
        return Location(self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def walk(self, node, path: tuple, depth: int) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise _err(f"the document expands to more than {MAX_NODES} nodes (an alias bomb?)", self.file,
                       node.start_mark, path, "specs are small: remove the repeated aliases")
        if depth > MAX_DEPTH:
            raise _err(f"nesting deeper than {MAX_DEPTH} levels", self.file, node.start_mark, path,
                       "specs are a few levels deep: look for unclosed brackets")
        if isinstance(node, yaml.MappingNode):
            if node.tag not in ("tag:yaml.org,2002:map",):
                raise _err(f"unsupported tag {node.tag}", self.file, node.start_mark, path,
                           "specs use plain mappings, lists and scalars only")
            out: dict = {}
            merged: dict = {}  # YAML merge keys (`<<: *base`): the mapping's own keys override merged ones
            for key_node, value_node in node.value:
                if key_node.tag == MERGE_TAG:
                    merged.update(self.merge(value_node, path, depth))
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    raise _err("mapping keys must be plain scalars", self.file, key_node.start_mark, path,
                               "write keys as plain words, e.g. `samples_per_prompt: 8`")
                key = self.scalar(key_node, path)
                if not isinstance(key, str):
                    key = "null" if key is None else str(key).lower() if isinstance(key, bool) else str(key)
                if key in out:
                    first = self.positions.get(path + (key,))
                    raise _err(f"duplicate key '{key}'" + (f" (first at line {first.line})" if first else ""),
                               self.file, key_node.start_mark, path + (key,), "remove one of the two")
                self.positions[path + (key,)] = self.loc(key_node)
                out[key] = self.walk(value_node, path + (key,), depth + 1)
            return {**{k: v for k, v in merged.items() if k not in out}, **out}
        if isinstance(node, yaml.SequenceNode):
            if node.tag != "tag:yaml.org,2002:seq":
                raise _err(f"unsupported tag {node.tag}", self.file, node.start_mark, path,
                           "specs use plain mappings, lists and scalars only")
            items = []
            for i, item in enumerate(node.value):
                self.positions[path + (i,)] = self.loc(item)
                items.append(self.walk(item, path + (i,), depth + 1))
            return items
        return self.scalar(node, path)

    def merge(self, node, path: tuple, depth: int) -> dict:
        """The mappings a merge key names; of several, the earlier ones win (YAML merge-key semantics)."""
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        out: dict = {}
        for src in sources:
            if not isinstance(src, yaml.MappingNode):
                raise _err("a merge key `<<` takes a mapping or a list of mappings", self.file, src.start_mark, path,
                           "write `<<: *anchor` where the anchor names a mapping")
            for k, v in self.walk(src, path, depth).items():
                out.setdefault(k, v)
        return out

    def scalar(self, node, path):
        try:
            value = self.loader.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError as e:
            raise _err(f"{e.problem}", self.file, node.start_mark, path, getattr(e, "hint", "")
                       or "Python object tags are not allowed in specs; write plain values") from None
        except Exception:  # an explicit tag the value does not fit (`!!int x`, `!!bool maybe`, `!!float nope`)
            raise _err(f"{node.value!r} cannot be read as {node.tag.rsplit(':', 1)[-1]}", self.file, node.start_mark,
                       path, "remove the explicit tag (or quote the value to make it a string)") from None
        if not isinstance(value, (str, int, float, bool, type(None))):
            raise _err(f"unsupported value of type {type(value).__name__}", self.file, node.start_mark, path,
                       "quote it to make it a string")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _err("a string with a lone surrogate escape (not valid Unicode)", self.file, node.start_mark,
                           path, "write the character itself, or a \\U escape of a real code point") from None
        return value


def _check_depth(text: str, file: str) -> None:
    """Refuse deep nesting from the event stream, before PyYAML's recursive composer sees it."""
    events = yaml.SafeLoader(text)
    depth = 0
    try:
        while events.check_event():
            event = events.get_event()
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH + 1:  # the top-level mapping is depth 1
                    raise _err(f"nesting deeper than {MAX_DEPTH} levels", file, event.start_mark, (),
                               "specs are a few levels deep: look for unclosed brackets")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    finally:
        events.dispose()


def _check_expansion(root, file: str) -> None:
    """Refuse a document whose aliases expand past MAX_NODES, or refer to themselves, before building anything.

    Aliases share their node, so sizes are counted once per distinct node (memoised): an alias bomb of
    a few lines is measured in microseconds instead of being expanded.
    """
    size: dict[int, int] = {}
    visiting: set[int] = set()

    def count(node) -> int:
        key = id(node)
        if key in size:
            return size[key]
        if key in visiting:
            raise _err("an alias refers to the node that contains it (an infinitely deep value)", file,
                       node.start_mark, (), "an anchor's value cannot contain an alias of itself")
        visiting.add(key)
        n = 1
        if isinstance(node, yaml.MappingNode):
            n += sum(count(k) + count(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(count(c) for c in node.value)
        visiting.discard(key)
        size[key] = n = min(n, MAX_NODES + 1)
        return n

    if count(root) <= MAX_NODES:
        return
    # name the biggest top-level entry
    where, path = root, ()
    if isinstance(root, yaml.MappingNode) and root.value:
        key_node, _ = max(root.value, key=lambda kv: size.get(id(kv[1]), 0))
        where, path = key_node, ((str(key_node.value),) if isinstance(key_node, yaml.ScalarNode) else ())
    raise _err(f"the document expands to more than {MAX_NODES} nodes through its aliases (an alias bomb?)", file,
               where.start_mark, path, "specs are small: remove the repeated aliases")


def _reader_err(e, text: str, file: str) -> SpecError:
    """A character YAML does not allow (a control character such as NUL), located."""
    pos = max(0, min(int(e.position or 0), len(text)))
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    code = e.character if isinstance(e.character, int) else ord(str(e.character)[:1] or "\0")
    return SpecError([Diagnostic("yaml", f"character #x{code:04x} is not allowed in YAML", (), Location(file, line, col),
                                 "remove it, or write it as an escape inside a double-quoted string")])


SYNTAX_HINTS = (
    ("'\\t'", "indent with spaces: YAML does not allow tabs"),
    ("undefined alias", "define the anchor (`&name`) before its first alias (`*name`)"),
    ("another document", "a spec is one YAML document: remove the `---` or what follows it"),
    ("mapping values are not allowed", "quote a value that contains `: `, or check the indentation"),
    ("could not find expected ':'", "a key needs `: value`; check the indentation and quotes"),
    ("found unexpected end of stream", "close the quoted string"),
    ("found character that cannot start any token", "quote a value that starts with @, ` or %"),
)


def _syntax_hint(problem: str) -> str:
    for needle, hint in SYNTAX_HINTS:
        if needle in problem:
            return hint
    return "check the indentation, brackets and quotes at and just before this position"


def parse_yaml(text: str, file: str) -> tuple[Any, dict]:
    """Parse one YAML document into (data, positions)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise _err(f"file larger than {MAX_FILE_BYTES} bytes", file, None, (), "specs are small YAML files")
    try:
        loader = SpecLoader(text)
    except yaml.reader.ReaderError as e:
        raise _reader_err(e, text, file) from None
    try:
        _check_depth(text, file)
        node = loader.get_single_node()
        if node is None:
            return None, {}
        _check_expansion(node, file)
        walker = _Walker(loader, file)
        return walker.walk(node, (), 0), walker.positions
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise _err(f"YAML syntax: {e.problem or e.context}", file, mark, (), _syntax_hint(str(e.problem or e.context)))\
            from None
    except yaml.reader.ReaderError as e:
        raise _reader_err(e, text, file) from None
    except yaml.YAMLError as e:
        raise _err(f"YAML: {e}", file, None, (), "fix the YAML near the start of the file") from None
    except RecursionError:
        raise _err(f"nesting deeper than {MAX_DEPTH} levels", file, None, (),
                   "specs are a few levels deep: look for unclosed brackets") from None
    finally:
        loader.dispose()


def deep_merge(base: Any, over: Any) -> Any:
    """Merge `over` onto `base`: mappings merge key by key, everything else is replaced.

    A component whose `kind` changes is replaced whole, so that switching `guide: {kind: none}` in a
    phase does not inherit the old guide's fields.
    """
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    if "kind" in base and "kind" in over and base["kind"] != over["kind"]:
        return over
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(base[key], value) if key in base else value
    return out


def read_text(path: Path) -> str:
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):  # opening a FIFO waits for a writer: refuse it unopened
            raise _err(f"is a {'named pipe (FIFO)' if stat.S_ISFIFO(mode) else 'socket'}, not a spec file", str(path),
                       None, (), "name a .yaml spec file")
        # O_NONBLOCK: a terminal or another device that has nothing to read fails instead of waiting
        flags = os.O_RDONLY | (os.O_NONBLOCK if stat.S_ISCHR(mode) else 0)
        with os.fdopen(os.open(path, flags), "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # never more: /dev/zero or a huge file must not fill memory
    except FileNotFoundError:
        raise _err("no such file", str(path), None, (), "check the path (overrides are written path.to.field=value)") \
            from None
    except IsADirectoryError:
        raise _err("is a directory, not a spec file", str(path), None, (), "name a .yaml spec file") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise _err(f"cannot read: {getattr(e, 'strerror', None) or e}", str(path), None, (),
                   "check the path and its permissions") from None
    if len(raw) > MAX_FILE_BYTES:
        raise _err(f"file larger than {MAX_FILE_BYTES} bytes", str(path), None, (), "specs are small YAML files")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError([Diagnostic("yaml", f"not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})", (),
                                    Location(str(path), line, col), "save the file as UTF-8")]) from None


def _link_loop(path: Path) -> str | None:
    """`a.yaml -> b.yaml -> a.yaml` when `path` is a symbolic link that leads back to itself, else None."""
    seen, cur = [], path
    for _ in range(40):  # the kernel gives up after 40 links too
        if not cur.is_symlink():
            return None
        if cur in seen:
            return " -> ".join(p.name for p in seen[seen.index(cur):] + [cur])
        seen.append(cur)
        cur = Path(os.path.normpath(cur.parent / os.readlink(cur)))  # `../dir/a.yaml` names the same link
    return " -> ".join(p.name for p in seen[:3]) + " -> ..."


def _resolve(path: Path, where: Location | None = None, key: tuple = ()) -> Path:
    """path.resolve(), or a SpecError that names the symbolic-link loop it runs into (Python raises
    RuntimeError there, OSError ELOOP from 3.13): was an "internal error"."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:
        loop = _link_loop(path)
        if loop is None and not isinstance(e, RuntimeError):
            raise
        what = f"a loop of symbolic links: {loop}" if loop else f"a symbolic link that cannot be followed ({e})"
        raise SpecError([Diagnostic("yaml", f"{str(path)!r} is {what}", key, where or Location(str(path), 1, 1),
                                    "point the link at a spec file (ls -l shows where each link leads)")]) from None


def _load_file(path: Path, stack: tuple) -> LoadedSpec:
    resolved = _resolve(path)
    file = str(path)
    data, positions = parse_yaml(read_text(path), file)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _err(f"a spec is a mapping of sections, not a {type(data).__name__}", file, None, (),
                   "start with `name: my_method`")
    parent = data.get("extends")
    if parent is None:
        return LoadedSpec(data, positions, file)
    if not isinstance(parent, str):
        loc = positions.get(("extends",))
        raise SpecError([Diagnostic("yaml", "`extends` takes a path to another spec", ("extends",), loc,
                                    "write `extends: grpo.yaml` (relative to this file)")])
    loc = positions.get(("extends",))
    home = resolved.parent  # where the file really is: a spec reached through a link extends its own neighbours
    base_path = home / parent
    base_resolved = _resolve(base_path, loc, ("extends",)) if base_path.is_symlink() else None
    try:
        exists = base_path.is_file()
        base_resolved = base_resolved or base_path.resolve()
    except (OSError, ValueError):  # a name too long, a NUL byte
        exists = False
    if not exists:
        siblings = [p.name for p in home.glob("*.yaml")]
        from composer.errors import did_you_mean
        raise SpecError([Diagnostic("yaml", f"`extends` names {parent!r}, which is not a spec file (looked in "
                                    f"{home})", ("extends",), loc, did_you_mean(Path(parent).name, siblings))])
    if base_resolved in stack + (resolved,):
        chain = " -> ".join(p.name for p in stack + (resolved, base_resolved))
        raise SpecError([Diagnostic("yaml", f"`extends` forms a cycle: {chain}", ("extends",), loc,
                                    "remove one `extends` from the cycle")])
    base = _load_file(base_path, stack + (resolved,))
    merged = deep_merge(base.data, {k: v for k, v in data.items() if k != "extends"})
    return LoadedSpec(merged, {**base.positions, **positions}, file)


def apply_overrides(spec: LoadedSpec, overrides: list[str]) -> LoadedSpec:
    """Apply `path.to.field=value` overrides (`train.steps=20 sync.every=10`). The value is read as YAML with
    the same rules as a file (YAML 1.2 core: `010` is 10, `1:30` is text), so a setting means the same on the
    command line as in the file."""
    if not overrides:
        return spec
    data, positions = spec.data, dict(spec.positions)
    for item in overrides:
        loc = Location(f"<override {item!r}>", 1, 1)
        if "=" not in item:
            raise SpecError([Diagnostic("yaml", "an override is `path.to.field=value`", (), loc,
                                        "for example train.steps=20")])
        path, value = item.split("=", 1)
        path = re.sub(r"\[(\d+)\]", r".\1", path.strip())  # stages[0].train.steps == stages.0.train.steps
        parts = path.split(".")
        if not path or any(not p.strip() or p != p.strip() for p in parts):
            raise SpecError([Diagnostic("yaml", f"cannot parse override: {path!r} is not a path.to.field", (), loc,
                                        "write path.to.field=value, e.g. train.steps=20")])
        if parts[0] == "extends":
            raise SpecError([Diagnostic("yaml", "`extends` cannot be overridden: it picks the file a spec builds on",
                                        ("extends",), loc, "write `extends:` in the spec file, or give the other "
                                        "spec file on the command line")])
        if not value.strip():  # `data.train=`: no value at all would reset the field to its default unseen
            key = tuple(int(p) if p.isdigit() else p for p in parts)
            raise SpecError([Diagnostic("yaml", f"the override `{item.strip()}` gives no value: an empty value would "
                                        f"silently reset {path} to its default", key, loc,
                                        f"give a value ({path}=VALUE); a field is reset to its default by deleting it "
                                        "from the spec (or leaving the override out), not by an empty value")])
        try:
            parsed, _ = parse_yaml(value, loc.file)
        except SpecError as e:
            first = e.diagnostics[0] if getattr(e, "diagnostics", None) else None
            why = first.message if first else str(e).splitlines()[0]
            raise SpecError([Diagnostic("yaml", f"cannot parse override: {why}", (), loc,
                                        "write path.to.field=value as in a YAML file; quote values with brackets, "
                                        "colons or spaces, e.g. 'summary=\"a: b\"'")]) from None
        if parsed == {}:  # merged key by key, an empty mapping adds nothing and removes nothing (issue 57)
            raise SpecError([Diagnostic("yaml", f"the override `{item.strip()}` is an empty mapping, which changes "
                                        f"nothing: an override is merged into {path} key by key, so it cannot empty it",
                                        tuple(int(p) if p.isdigit() else p for p in parts), loc,
                                        f"set the fields you mean ({path}.FIELD=VALUE); to remove entries of {path}, "
                                        "delete them from the spec file")])
        glued = _glued_key(parsed)
        if glued is not None:  # `{kind:linear}`: YAML reads `kind:linear` as one key with no value
            raise SpecError([Diagnostic("yaml", f"cannot parse override: `{glued}` is read as one key with no value "
                                        "(YAML needs a space after the colon in `key: value`)",
                                        tuple(int(p) if p.isdigit() else p for p in parts), loc,
                                        f"write `{glued.replace(':', ': ', 1)}`, e.g. "
                                        f"'{path}={{kind: linear, start: 0.01, end: 0, steps: 10}}' (quoted for the shell)")])
        conf = parsed
        for part in reversed(parts):
            conf = {part: conf}
        key = tuple(int(p) if p.isdigit() else p for p in parts)
        data = _set_path(data, key, conf) if any(isinstance(k, int) for k in key) else deep_merge(data, conf)
        for n in range(1, len(key) + 1):  # a misspelt section (`trian.steps=3`) is located at the override too
            if n == len(key) or key[:n] not in positions:
                positions[key[:n]] = loc
    return LoadedSpec(data, positions, spec.file)


def _glued_key(value) -> str | None:
    """The first mapping key written `a:b` without a space (so YAML made it one key with a null value)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and re.fullmatch(r"[^\s:]+:[^\s]+", k):
                return k
            found = _glued_key(v)
            if found:
                return found
    if isinstance(value, list):
        return next((g for g in map(_glued_key, value) if g), None)
    return None


def _set_path(data: dict, key: tuple, conf: dict):
    """Set one override whose path indexes a list (`stages.0.train.steps=5`), merging at the leaf."""
    value = conf
    for part in key:  # OmegaConf nests the value under the same parts, list indices as string keys
        value = value[str(part)] if isinstance(value, dict) and str(part) in value else value.get(part, value)

    def put(node, rest):
        head = rest[0]
        if isinstance(head, int):
            if not isinstance(node, list) or not 0 <= head < len(node):
                raise KeyError(head)
            node = list(node)
        else:
            node = dict(node) if isinstance(node, dict) else {}
        if len(rest) == 1:
            node[head] = deep_merge(node[head], value) if isinstance(node, dict) and head in node else value
        else:
            node[head] = put(node[head] if (isinstance(node, list) or head in node) else {}, rest[1:])
        return node

    try:
        return put(data, key)
    except (KeyError, TypeError):
        loc = Location(f"<override {'.'.join(map(str, key))}>", 1, 1)
        raise SpecError([Diagnostic("yaml", "the override's path indexes a list item that does not exist", key,
                                    loc, "check the index (lists count from 0)")]) from None


def load_spec(path: str | Path, overrides: list[str] | None = None) -> LoadedSpec:
    """Layer 1: read the YAML (with `extends`) and apply overrides. Raises SpecError."""
    spec = _load_file(Path(path), ())
    return apply_overrides(spec, overrides or [])


def load_text(text: str, file: str = "<spec>") -> LoadedSpec:
    data, positions = parse_yaml(text, file)
    if not isinstance(data, dict):
        raise _err("a spec is a mapping of sections", file, None, (), "start with `name: my_method`")
    return LoadedSpec(data, positions, file)
