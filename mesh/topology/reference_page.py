"""The topology reference page (docs/topology-reference.md): every key a topology takes, from the schema.

The page is generated so that it cannot drift from the schema (``mesh/topology/schema.py`` and the config
classes it is built of): ``tests/test_docs.py`` regenerates it and fails when the committed page
differs. A key's description is the documentation its field already has, the first found of:
pydantic's ``Field(description=...)``; the comment on the field's line, or the comment lines right
above it; a docstring sentence that defines it (``- ``key``: ...``); a docstring sentence naming it.
The class that introduces a field is asked before the classes that override it, whose comments are
about their defaults. Tasks are read from their classes' source with ``ast``, never imported: a
task's module may import its library (verifiers) as it loads, and the page must not depend on what
is installed. Nothing here imports torch or a backend, as the topology check does not.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from actors import registry
from mesh.topology.grammars import Grammar
from mesh.topology.launcher import LAUNCHERS, LauncherOptions
from mesh.topology.schema import TaskSection, Topology

WIDTH = 120
COMMAND = "python -m mesh.reference > docs/topology-reference.md"
REQUIRED = object()  # the default of a key that must be given
# a sentence ends at a full stop before a capital or code, not at an abbreviation's ("e.g. SDPO", "Dr. GRPO")
SENTENCE_END = re.compile(r"(?<=\.)(?<!e\.g\.)(?<!i\.e\.)(?<!Dr\.)(?<!vs\.)\s+(?=[A-Z`(])")
# ``key``: text, ``key: value`` (note): text, or ``a``/``b``: text, at the start of a sentence
DEFINITION = re.compile(r"^``(\w+)(?:: ([^`]+))?``((?:/``\w+``)*)(?: \(([^)]*)\))?: (.+)$", re.S)
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >="}
SCALARS = {int: "int", float: "float", bool: "bool", str: "string", Any: "any", type(None): "null"}
# Markdown reads a line that starts so as a new list item, heading or quote: never wrap a line there.
BLOCK_START = re.compile(r" (?=[-+*>#|]\s|\d+[.)]\s)")


@dataclass(frozen=True)
class Entry:
    """One field of a section, as its class declares it."""

    name: str
    type: Any  # a type, or for a task parameter the annotation's source text
    default: Any  # REQUIRED, or the value (for a task parameter: the default's source text)
    description: str


@dataclass(frozen=True)
class Key:
    """One line of the page: a dotted path (``<name>`` for a mapping's keys, ``[]`` for a list's items)."""

    path: str
    type: str
    default: str
    description: str


@dataclass
class Block:
    """One heading of the page: a section of the topology, or one variant of it, with its keys."""

    path: str
    title: str
    intro: str
    keys: list[Key] = field(default_factory=list)


# ----------------------------------------------------------------------------- source and comments


@dataclass(frozen=True)
class Source:
    """A module's syntax tree and comments (line -> text, for comments alone on their line too)."""

    tree: ast.Module
    trailing: dict[int, str]
    alone: dict[int, str]


@cache
def _source(path: str) -> Source:
    text = Path(path).read_text(encoding="utf-8")
    trailing, alone = {}, {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT and not token.string.startswith(("# noqa", "# type:")):
            own_line = not token.line[: token.start[1]].strip()
            (alone if own_line else trailing)[token.start[0]] = token.string.lstrip("#").strip()
    return Source(ast.parse(text), trailing, alone)


def _classdef(source: Source, name: str) -> ast.ClassDef:
    return next(node for node in source.tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def _comment(source: Source, first: int, last: int) -> str:
    """The comment ending line ``last`` of a statement that starts on ``first``, else those right above it."""
    if last in source.trailing:
        return source.trailing[last]
    above, line = [], first - 1
    while line in source.alone:
        above.insert(0, source.alone[line])
        line -= 1
    return " ".join(above)


def _statement(node: ast.ClassDef, name: str) -> ast.AnnAssign | None:
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and getattr(statement.target, "id", None) == name:
            return statement
    return None


# ----------------------------------------------------------------------------- docstrings


def _sentences(doc: str | None) -> list[str]:
    """A docstring's sentences, each on one line; a list item starts a sentence."""
    items = re.split(r"\n\s*\n|\n(?=\s*- )", inspect.cleandoc(doc or ""))
    joined = (" ".join(item.split()).removeprefix("- ") for item in items)
    return [sentence for item in joined for sentence in SENTENCE_END.split(item) if sentence]


def _defined(doc: str | None, name: str) -> str:
    """What the docstring's sentences that define ``name`` (``- ``name``: ...``) say of it."""
    said = []
    for sentence in _sentences(doc):
        match = DEFINITION.match(sentence)
        if match and name in (match[1], *re.findall(r"``(\w+)``", match[3])):
            value, note, text = match[2], match[4], match[5]
            said.append(f"``{value}``{f' ({note})' if note else ''}: {text}" if value else text)
    return " ".join(said)


def _mentioned(doc: str | None, name: str) -> str:
    """The docstring's first sentence naming ``name`` in code."""
    return next((s for s in _sentences(doc) if re.search(rf"``{name}\b", s)), "")


def _intro(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join(inspect.cleandoc(doc or "").split("\n\n")[0].split())


# ----------------------------------------------------------------------------- the schema's classes


def _structured(tp: Any) -> bool:
    return isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp))


def _bare(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def _options(tp: Any) -> list[Any]:
    """The members of a union (a type alone is a union of one), ``None`` left out."""
    tp = _bare(tp)
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return [member for member in members if member is not type(None)]


@cache
def _class_source(cls: type) -> tuple[Source, ast.ClassDef]:
    source = _source(inspect.getsourcefile(cls))
    return source, _classdef(source, cls.__name__)


def _docstring(cls: type) -> str | None:
    """A class's own docstring, from its source (a dataclass without one has a generated ``__doc__``)."""
    return ast.get_docstring(_class_source(cls)[1])


def _declaring(cls: type, name: str) -> list[type]:
    """The classes of ``cls``'s MRO that declare field ``name``, the one introducing it first."""
    return [c for c in reversed(cls.__mro__) if name in vars(c).get("__annotations__", {})]


def _description(cls: type, name: str, given: str | None = None) -> str:
    """What the schema says of field ``name`` of ``cls`` (see the module docstring for the order)."""
    owners = _declaring(cls, name)
    found = [given or ""]
    for owner in owners:
        source, node = _class_source(owner)
        statement = _statement(node, name)
        comment = _comment(source, statement.lineno, statement.end_lineno) if statement else ""
        found += [comment, _defined(ast.get_docstring(node), name)]
    found += [_mentioned(_docstring(owner), name) for owner in owners]
    return next((text for text in found if text), "")


def _entries(cls: type) -> list[Entry]:
    """The fields of a section class, pydantic model or dataclass, as a topology spells them."""
    if issubclass(cls, BaseModel):
        return [_model_entry(cls, name, info) for name, info in cls.model_fields.items()]
    hints = typing.get_type_hints(cls, include_extras=True)
    return [
        Entry(f.name, hints[f.name], _dataclass_default(f), _description(cls, f.name))
        for f in dataclasses.fields(cls)
        if f.init and not f.name.startswith("_")
    ]


def _model_entry(cls: type[BaseModel], name: str, info: Any) -> Entry:
    if info.is_required():
        default = REQUIRED
    else:
        default = info.default_factory() if info.default_factory is not None else info.default
    tp = typing.Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return Entry(name, tp, default, _description(cls, name, info.description))


def _dataclass_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED


# ----------------------------------------------------------------------------- types and values


def _type_name(tp: Any) -> str:
    """A field's type in a topology's words (YAML's, not Python's)."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *metadata = typing.get_args(tp)
        return _annotated(_type_name(base), metadata)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " or ".join(f"`{_value(arg)}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args)
    if origin is tuple:
        items = [_type_name(arg) for arg in args if arg is not Ellipsis]
        return f"list of {items[0]}" if Ellipsis in args else f"[{', '.join(items)}]"
    if origin in (dict, typing.Mapping):
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if _structured(tp):
        return "section"
    return SCALARS.get(tp, getattr(tp, "__name__", str(tp)))


def _annotated(name: str, metadata: list[Any]) -> str:
    """``name`` with what its pydantic metadata says: bounds, a pattern, a launcher grammar's name."""
    said = []
    for item in metadata:
        said += [f"{sign} {getattr(item, bound)}" for bound, sign in BOUNDS.items() if hasattr(item, bound)]
        if getattr(item, "pattern", None):
            said.append(f"matching `{item.pattern}`")
        grammar = getattr(getattr(item, "func", None), "__self__", None)
        if isinstance(grammar, Grammar):
            said.append(grammar.what)
    return f"{name} ({', '.join(said)})" if said else name


def _value(value: Any) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return f"[{', '.join(map(_value, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return '""' if value == "" else str(value)


# ----------------------------------------------------------------------------- walking the schema


def _blocks(cls: type, path: str, title: str = "", intro: str | None = None) -> list[Block]:
    """The block of section ``cls`` at ``path``, then the blocks of the sections inside it."""
    intro = _intro(_docstring(cls)) if intro is None else intro
    return _section(path, title or f"`{path}`", intro, _entries(cls))


def _section(path: str, title: str, intro: str, entries: list[Entry]) -> list[Block]:
    """The block holding ``entries`` at ``path``, then the blocks of the sections inside them."""
    block, inner = Block(path, title, intro), []
    for entry in entries:
        key, blocks = _expand(entry, f"{path}.{entry.name}" if path else entry.name)
        block.keys.append(_unrepeated(key, block.intro))
        inner += blocks
    return [block, *inner]


def _unrepeated(key: Key, intro: str) -> Key:
    """``key`` without a description its block's introduction already says (a docstring sentence naming it)."""
    return dataclasses.replace(key, description="") if key.description in _sentences(intro) else key


def _expand(entry: Entry, path: str) -> tuple[Key, list[Block]]:
    """The key of ``entry`` and, for a section, the blocks of what is inside it."""
    options, optional = _options(entry.type), type(None) in typing.get_args(_bare(entry.type))
    shape, chooser = _type_name(entry.type), None
    blocks: list[Block] = []
    if options == [TaskSection]:
        blocks = [*_blocks(TaskSection, path), *_task_blocks(path)]
    elif options == [LauncherOptions]:
        chooser, blocks = "kind", _variant_blocks(path, "kind", _launcher_options())
    elif len(options) > 1 and all(map(_structured, options)):
        chooser = _discriminator(options[0])
        blocks = _variant_blocks(path, chooser, options)
    elif len(options) == 1 and _structured(options[0]):
        blocks = _blocks(options[0], path)
    elif typing.get_origin(options[0]) is dict and _structured(typing.get_args(options[0])[1]):
        blocks = _blocks(typing.get_args(options[0])[1], f"{path}.<name>")
    elif typing.get_origin(options[0]) is tuple and _structured(typing.get_args(options[0])[0]):
        blocks = _blocks(typing.get_args(options[0])[0], f"{path}[]")
    if blocks:
        shape = f"{'section or null' if optional else 'section'}: [its keys](#{slug(blocks[0].title)})"
    return Key(path, shape, _default_text(entry.default, bool(blocks), chooser), entry.description), blocks


def _default_text(value: Any, section: bool, chooser: str | None) -> str:
    """How a key's line states its default: a value, a variant's name, or a section's own defaults."""
    if value is REQUIRED:
        return "required"
    if chooser is not None and value is not None:
        return f"default `{chooser}: {_value(getattr(value, chooser))}`"
    if section and _structured(type(value)):
        return "default: its keys' defaults"
    return f"default `{_value(value)}`"


def _discriminator(cls: type) -> str:
    """The field whose one literal value names a variant (``name: Literal["dapo"]``)."""
    for entry in _entries(cls):
        if typing.get_origin(entry.type) is Literal and len(typing.get_args(entry.type)) == 1:
            return entry.name
    raise ValueError(f"{cls.__name__} has no field naming it among its union's variants")


def _variant_blocks(path: str, chooser: str, variants: list[type]) -> list[Block]:
    """The keys every variant of a section has with the same default, then a block for each variant with its
    own keys and its own defaults (the sections inside each after it)."""
    fields = [{entry.name: entry for entry in _entries(variant)} for variant in variants]
    shared = [
        entry
        for name, entry in fields[0].items()
        if name != chooser and all(name in own and own[name].default == entry.default for own in fields)
    ]
    base = next(c for c in variants[0].__mro__ if all(issubclass(v, c) for v in variants))
    common = _section(path, f"`{path}`: the keys of every `{chooser}`", _intro(_docstring(base)), shared)
    blocks = common if shared else []
    for variant, own in zip(variants, fields, strict=True):
        source, node = _class_source(variant)
        intro = _intro(ast.get_docstring(node) or ast.get_docstring(source.tree))
        title = f"`{path}` with `{chooser}: {_value(typing.get_args(own[chooser].type)[0])}`"
        blocks += _section(path, title, intro, [e for e in own.values() if e not in shared])
    return blocks


def _launcher_options() -> list[type[LauncherOptions]]:
    return [registry.load_target("launcher", kind, target) for kind, target in LAUNCHERS.items()]


# ----------------------------------------------------------------------------- tasks, read from source


def _task_blocks(path: str) -> list[Block]:
    """A block for each registered task: its parameters, read from its class's source."""
    blocks = []
    for name, backend in registry.BACKENDS["task"].items():
        module, _, class_name = backend.target.partition(":")
        source, node = _task_class(module, class_name)
        intro = _intro(ast.get_docstring(node) or ast.get_docstring(source.tree))
        keys = [_unrepeated(_task_key(path, entry), intro) for entry in _parameters(module, class_name)]
        blocks.append(Block(path, f"`{path}` with `name: {name}`", intro, keys))
    return blocks


def _task_key(path: str, entry: Entry) -> Key:
    default = "required" if entry.default is REQUIRED else f"default `{entry.default}`"
    return Key(f"{path}.{entry.name}", f"`{entry.type}`", default, entry.description)


@cache
def _task_class(module: str, name: str) -> tuple[Source, ast.ClassDef]:
    spec = registry.module_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"task module {module!r} cannot be found, so its parameters cannot be read")
    source = _source(spec.origin)
    return source, _classdef(source, name)


def _parameters(module: str, name: str) -> list[Entry]:
    """A task class's constructor parameters: its ``__init__``'s, else its dataclass fields, bases first."""
    source, node = _task_class(module, name)
    init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    if init is not None:
        return list(_init_parameters(module, name, init))
    fields: dict[str, Entry] = {}
    for base in node.bases:
        if (found := _base_module(module, source, ast.unparse(base))) is not None:
            fields |= {entry.name: entry for entry in _parameters(found, ast.unparse(base))}
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and _is_parameter(statement):
            entry = _field_parameter(module, name, statement)
            fields[entry.name] = entry if entry.name not in fields or entry.description else _keep(fields, entry)
    return list(fields.values())


def _keep(fields: dict[str, Entry], entry: Entry) -> Entry:
    """An overriding field (a new default) keeps the description of the field it overrides."""
    return dataclasses.replace(entry, description=fields[entry.name].description)


def _base_module(module: str, source: Source, base: str) -> str | None:
    """The module a base class of a task is defined in (this one, or the one it is imported from), or None
    when it is not Python source (``abc.ABC`` is frozen into the interpreter)."""
    if any(isinstance(n, ast.ClassDef) and n.name == base for n in source.tree.body):
        return module
    for node in source.tree.body:
        if isinstance(node, ast.ImportFrom) and base in (alias.name for alias in node.names):
            spec = registry.module_spec(node.module)
            return node.module if spec is not None and str(spec.origin).endswith(".py") else None
    return None


def _is_parameter(statement: ast.AnnAssign) -> bool:
    """A dataclass field the constructor takes: not private, not a ClassVar, not ``field(init=False)``."""
    name, annotation = statement.target.id, ast.unparse(statement.annotation)
    init_false = "init=False" in ast.unparse(statement.value) if statement.value else False
    return not name.startswith("_") and not annotation.startswith("ClassVar") and not init_false


def _field_parameter(module: str, name: str, statement: ast.AnnAssign) -> Entry:
    source, _ = _task_class(module, name)
    return Entry(
        statement.target.id,
        ast.unparse(statement.annotation),
        _source_default(statement.value),
        _comment(source, statement.lineno, statement.end_lineno) or _task_doc(module, name, statement.target.id),
    )


def _init_parameters(module: str, name: str, init: ast.FunctionDef) -> Iterator[Entry]:
    source, _ = _task_class(module, name)
    args = init.args.args[1:]
    defaults = [None] * (len(args) - len(init.args.defaults)) + list(init.args.defaults)
    for arg, default in zip(args, defaults, strict=True):
        last = default.end_lineno if default is not None else arg.end_lineno
        description = _comment(source, arg.lineno, last) or _task_doc(module, name, arg.arg)
        annotation = ast.unparse(arg.annotation) if arg.annotation else "any"
        yield Entry(arg.arg, annotation, REQUIRED if default is None else _source_default(default), description)


def _source_default(value: ast.expr | None) -> Any:
    """A default as its source writes it: a constant's value, a factory's product, else the expression."""
    if value is None:
        return REQUIRED
    if isinstance(value, ast.Constant):
        return _value(value.value)
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
        factory = next((k.value for k in value.keywords if k.arg == "default_factory"), None)
        if isinstance(factory, ast.Lambda):
            return ast.unparse(factory.body)
        return f"{ast.unparse(factory)}()" if factory is not None else _source_default(value.keywords[0].value)
    return ast.unparse(value)


def _task_doc(module: str, name: str, parameter: str) -> str:
    """A task parameter's description from docstrings: a definition in its class's, its module's or its other
    classes', else a sentence of its class's or its module's naming it."""
    source, node = _task_class(module, name)
    others = [n for n in source.tree.body if isinstance(n, ast.ClassDef) and n is not node]
    docs = [ast.get_docstring(node), ast.get_docstring(source.tree), *map(ast.get_docstring, others)]
    found = [_defined(doc, parameter) for doc in docs] + [_mentioned(doc, parameter) for doc in docs[:2]]
    return next((text for text in found if text), "")


# ----------------------------------------------------------------------------- the page


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation (but ``-`` and ``_``) dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def blocks() -> list[Block]:
    """Every section of a topology, in the schema's order, the variants of a section after it."""
    return _blocks(Topology, "", "The top level")


def keys() -> list[Key]:
    """Every key a topology takes (a variant's under its section's path)."""
    return [key for block in blocks() for key in block.keys]


def _markdown(text: str) -> str:
    """Docstring text as Markdown: code in single backticks, and outside code a ``<`` that would open an HTML
    tag (``<the run's directory>``) kept literal."""
    parts = re.split(r"(`[^`]*`)", text.replace("``", "`"))
    return "".join(part if part.startswith("`") else re.sub(r"<(?=[A-Za-z/!?])", r"\\<", part) for part in parts)


def _wrapped(line: str, indent: str = "") -> list[str]:
    """``line`` cut to the page's width in bytes (what ``awk 'length > 120'`` counts), never where Markdown
    would read a new block."""
    guarded = BLOCK_START.sub("\u00a0", line)
    for width in range(WIDTH, 0, -1):
        lines = textwrap.wrap(guarded, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
        if all(len(each.encode()) <= WIDTH for each in lines):
            return [each.replace("\u00a0", " ") for each in lines]
    raise ValueError(f"a word longer than {WIDTH} bytes cannot be wrapped: {line!r}")


def _key_lines(key: Key, told_at: str | None) -> list[str]:
    """A key's bullet; a description the page already gave the same path (another variant's, under the heading
    ``told_at``) links there."""
    shown = f"see [above](#{told_at})" if told_at else _markdown(key.description)
    return _wrapped(f"- `{key.path}` ({key.type}; {key.default}){f': {shown}' if key.description else ''}", "  ")


def page() -> str:
    """The whole reference page, as committed in docs/topology-reference.md."""
    head = [
        "# Topology reference",
        "",
        f"<!-- Generated by `{COMMAND}`: change the schema, then run it again. -->",
        "",
        *_wrapped(
            "Every key a topology file takes, with its type, its default and what the schema's own documentation "
            "says of it, generated from the schema (`mesh/topology/schema.py` and the config classes it is built of). "
            "A dotted path names a nested key; `<name>` stands for a key you choose (a mesh's or a teacher's "
            "name), `[]` for each item of a list. Any key can be overridden from the command line with "
            "`--set path=value`; see [Topologies](topologies.md) for how a topology runs and what is checked. "
            "The top level links to each section."
        ),
    ]
    said: dict[tuple[str, str], str] = {}
    body = [line for block in blocks() for line in _block_lines(block, said)]
    return "\n".join([*head, *body]) + "\n"


def _block_lines(block: Block, said: dict[tuple[str, str], str]) -> list[str]:
    """A block's heading, introduction and keys; ``said`` maps each (path, description) to the anchor of the
    block that first gave it."""
    intro = ["", *_wrapped(_markdown(block.intro))] if block.intro else []
    keys = [line for key in block.keys for line in _key_lines(key, said.get((key.path, key.description)))]
    for key in block.keys:
        said.setdefault((key.path, key.description), slug(block.title))
    return ["", f"## {block.title}", *intro, "", *keys]

