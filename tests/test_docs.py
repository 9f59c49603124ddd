"""The README and docs/ stay true: every relative link and anchor resolves, every command that runs the project
parses against its command line and its topology loads with its ``--set`` overrides, every YAML snippet is a valid
part of a topology, and the topology reference is the one the schema generates. All in-process (no ``mesh.run``
subprocess per command), so a renamed key or flag fails here in seconds instead of in a reader's terminal."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from mesh import ctl, export, report, run
from mesh.launchers import forkserver
from mesh.topology import reference_page
from mesh.topology.preflight import load_plan
from mesh.topology.schema import Topology, TopologyError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGENERATE = "python -m mesh.reference > docs/topology-reference.md"
MAX_LINE_BYTES = 120  # what `awk 'length > 120'` counts on this machine (mawk: bytes)
MAX_README_LINES = 300
SHELL = ("bash", "sh", "shell", "console")
PARSERS = {
    "mesh.report": report._parser,
    "mesh.ctl": ctl._parser,
    "mesh.export": export._parser,
    "mesh.launchers.forkserver": forkserver._parser,
}
# <!-- docs-check: skip (why) --> right above a YAML fence: the snippet holds placeholders, so only its keys are checked
SKIP = re.compile(r"^\s*<!-- docs-check: skip \((.+)\) -->\s*$", re.M)
PLACEHOLDER = re.compile(r"<[^<>]*>")  # <image>, runs/<run>/...: a value the reader fills in
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPLACED_WHOLE = ("model", "task")  # a snippet's model or task is another one, not more keys for the base's


@dataclass(frozen=True)
class Fence:
    """A fenced code block of a page: its language, its text (unindented) and where it starts."""

    page: Path
    line: int
    language: str
    body: str
    skip: str | None  # the reason of a skip marker right above it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fences(page: Path) -> list[Fence]:
    """Every fenced block of ``page``, indented ones (inside a list item) included."""
    lines, found, at = page.read_text(encoding="utf-8").split("\n"), [], 0
    while at < len(lines):
        opening = re.match(r"(\s*)```(\w*)\s*$", lines[at])
        if not opening:
            at += 1
            continue
        indent, end = opening[1], at + 1
        while lines[end].strip() != "```":
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[at + 1 : end])
        marker = SKIP.match(lines[at - 1]) if at else None
        found.append(Fence(page, at + 1, opening[2], body, marker[1] if marker else None))
        at = end + 1
    return found


def prose(page: Path) -> str:
    """``page`` without its fenced blocks (a link or heading inside code is not one)."""
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings, a repeated heading's with ``-1``, ``-2``, ..."""
    found, repeats = set(), {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", prose(page), flags=re.M):
        base = reference_page.slug(heading)
        found.add(f"{base}-{repeats[base]}" if base in repeats else base)
        repeats[base] = repeats.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file does not exist or whose ``#anchor`` is no heading of it."""
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading of {file.relative_to(ROOT)} has the anchor #{anchor}")
    return broken


# ----------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """One ``python -m mesh.<module> ...`` of a shell block."""

    where: str
    module: str
    args: list[str]


def commands() -> list[Command]:
    """Every command of the pages' shell blocks that runs the project (``\\`` continuations joined, comments
    dropped, ``&&`` chains split)."""
    found = []
    for page in PAGES:
        for fence in fences(page):
            if fence.language in SHELL:
                found += [Command(fence.where, m, args) for m, args in _project_commands(fence.body)]
    return found


def _project_commands(script: str) -> list[tuple[str, list[str]]]:
    result = []
    for line in script.replace("\\\n", " ").splitlines():
        for part in _chain(shlex.split(line, comments=True)):
            if part[:2] == ["python", "-m"] and len(part) > 2 and part[2].startswith("mesh."):
                result.append((part[2], part[3:]))
    return result


def _chain(words: list[str]) -> list[list[str]]:
    """A command line's commands: its words split at ``&&``, ``||``, ``;``, ``|`` and ``&``."""
    chain: list[list[str]] = [[]]
    for word in words:
        if word in ("&&", "||", ";", "|", "&"):
            chain.append([])
        else:
            chain[-1].append(word)
    return chain


def check_run(args: list[str]) -> None:
    """``python -m mesh.run ARGS`` as ``--dry-run`` would read it: the flags parse, each ``--set`` key is the
    schema's, and the topology loads with its overrides (``placed_here=False``: a GPU node's or a cluster's job is
    described on any machine). A ``--set`` whose value is a placeholder (``<image>``) is checked by its key alone; a
    run directory or checkpoint (``--resume``, ``--retrain``) is only parsed: it does not exist here."""
    parsed = parse(run._parser(), args)
    concrete = [item for item in parsed.set if not PLACEHOLDER.search(item)]
    unknown = [item for item in parsed.set if not known_key(item.partition("=")[0])]
    assert not unknown, f"--set names keys the schema does not have: {unknown}"
    topology = ROOT / parsed.topology
    if parsed.replica is not None:
        concrete = run.replica_overrides(str(topology), concrete, parsed.replica)
    load_plan(topology, concrete, placed_here=False)


def parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    """``args`` as ``parser`` reads them; argparse exits on a flag it does not know, which fails the test instead."""
    try:
        return parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{parser.prog} refuses {shlex.join(args)} (argparse's message is in the captured stderr)")


def known_key(dotted: str) -> bool:
    """Whether ``dotted`` is a key of the schema: one of the reference's paths (``<name>`` matching any name), or
    a key inside one that takes any mapping (``task.dataset.path``, ``actors.trainer.custom_loss.kwargs.x``)."""
    parts = dotted.split(".")
    for key in KEYS:
        path = key.path.replace("[]", "").split(".")
        matched = len(path) <= len(parts) and all(p in (q, "<name>") for p, q in zip(path, parts, strict=False))
        if matched and (len(path) == len(parts) or re.search(r"mapping|Mapping|dict", key.type)):
            return True
    return False


KEYS = reference_page.keys()


# ----------------------------------------------------------------------------- YAML snippets


def shipped() -> list[Path]:
    """The shipped topologies, ``tiny.yaml`` first: a snippet is merged into each until one takes it."""
    others = sorted(p for p in (ROOT / "topologies").glob("*.yaml") if p.name != "tiny.yaml")
    return [ROOT / "topologies" / "tiny.yaml", *others]


def merged(base: dict, snippet: dict, top: bool = True) -> dict:
    """``snippet`` laid over ``base``, mappings merged key by key; a ``model`` or ``task`` replaces the base's."""
    out = dict(base)
    for key, value in snippet.items():
        whole = top and key in REPLACED_WHOLE
        mergeable = isinstance(value, dict) and isinstance(out.get(key), dict) and not whole
        out[key] = merged(out[key], value, top=False) if mergeable else value
    return out


def snippet_keys(node: Any, path: str = "") -> list[str]:
    """The dotted key paths a YAML snippet sets (a list's mappings under ``path[]``)."""
    if isinstance(node, list):
        return [key for item in node for key in snippet_keys(item, path)]
    if not isinstance(node, dict):
        return [path] if path else []
    return [key for name, value in node.items() for key in snippet_keys(value, f"{path}.{name}" if path else name)]


def loads_in_a_shipped_topology(snippet: dict, tmp_path: Path) -> list[str]:
    """Every shipped topology's refusal of ``snippet`` laid over it: empty once one takes it (a snippet may need
    its context: an agent task takes no warm start, so ``tiny.yaml`` refuses it where ``agent_tools.yaml`` does
    not). A snippet that is a whole topology is loaded alone."""
    required = {name for name, field in Topology.model_fields.items() if field.is_required()}
    whole = required <= set(snippet)
    bases = [{}] if whole else [yaml.safe_load(path.read_text(encoding="utf-8")) for path in shipped()]
    refusals = []
    for number, base in enumerate(bases):
        file = tmp_path / f"snippet_{number}.yaml"
        file.write_text(yaml.safe_dump(merged(base, snippet)), encoding="utf-8")
        try:
            load_plan(file, placed_here=False)
            return []
        except TopologyError as error:
            refusals.append(str(error))
    return refusals


def yaml_fences() -> list[Fence]:
    return [fence for page in PAGES for fence in fences(page) if fence.language == "yaml"]


# ----------------------------------------------------------------------------- the tests


def test_the_readme_opens_with_the_two_commands_ci_runs():
    """CI's ``.ci/run`` runs the README's test command verbatim, so the two must not drift apart."""
    first = fences(ROOT / "README.md")[0].body.splitlines()
    assert first[0].startswith("bash .ci/setup && python -m mesh.run topologies/tiny.yaml ")
    assert first[1].startswith("bash .ci/setup && python -m pytest -q ")
    command = first[1].split("#")[0].strip()
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_the_readme_is_short_and_every_line_fits():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= MAX_README_LINES
    long = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in PAGES
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if len(line.encode()) > MAX_LINE_BYTES
    ]
    assert not long, f"lines longer than {MAX_LINE_BYTES} bytes: {long}"


def test_every_relative_link_and_anchor_resolves():
    broken = [f"{page.relative_to(ROOT)}: {link}" for page in PAGES for link in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_readme_and_the_index_link_every_page():
    pages = {page.name for page in PAGES if page.parent.name == "docs" and page.name != "README.md"}
    index = {Path(t.partition("#")[0]).name for t in LINK.findall(prose(ROOT / "docs" / "README.md"))}
    readme = {t.partition("#")[0].removeprefix("docs/") for t in LINK.findall(prose(ROOT / "README.md"))}
    assert pages <= index, f"docs/README.md does not link {sorted(pages - index)}"
    assert pages | {"README.md"} <= readme, f"README.md does not link {sorted(pages | {'README.md'} - readme)}"


def test_the_topology_reference_is_the_one_the_schema_generates():
    committed = (ROOT / "docs" / "topology-reference.md").read_text(encoding="utf-8")
    assert reference_page.page() == committed, f"docs/topology-reference.md is stale: run `{REGENERATE}`"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("The KL penalty's reference model", "the-kl-penaltys-reference-model"),
        ("Experiment trackers: W&B and trackio", "experiment-trackers-wb-and-trackio"),
        ("DiLoCo: replicas that sync every H steps", "diloco-replicas-that-sync-every-h-steps"),
        (
            "A real model: what each channel adds (`bench/smol_math.py`)",
            "a-real-model-what-each-channel-adds-benchsmol_mathpy",
        ),
    ],
)
def test_anchors_are_githubs(heading, anchor):
    """The slug rule the link check and the reference page use gives the anchors the README linked to before it
    was split into docs/, which were written against GitHub's rendering."""
    assert reference_page.slug(heading) == anchor


def test_the_pages_run_every_command_line_they_document():
    """The extraction found what the checks below check: a page that stops showing a module is a choice, not a
    parser that lost its commands."""
    assert {command.module for command in commands()} == {"mesh.run", *PARSERS}


@pytest.mark.parametrize("command", commands(), ids=lambda c: f"{c.where}:{c.module}:{' '.join(c.args)[:60]}")
def test_a_documented_command_parses_and_its_topology_loads(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # relative paths in a topology start where the run starts
    if command.module == "mesh.run":
        check_run(command.args)
    elif command.module in PARSERS:
        parse(PARSERS[command.module](), command.args)
    else:
        pytest.fail(f"python -m {command.module} has no check here: add its parser to PARSERS")


@pytest.mark.parametrize("fence", yaml_fences(), ids=lambda f: f.where)
def test_a_yaml_snippet_is_part_of_a_topology(fence, tmp_path, monkeypatch):
    """Each key a snippet sets is the schema's; unless marked as holding placeholders, the snippet also loads,
    laid over a shipped topology."""
    monkeypatch.chdir(ROOT)
    snippet = yaml.safe_load(fence.body)
    assert isinstance(snippet, dict), "a YAML snippet must be a mapping of topology keys"
    unknown = [key for key in snippet_keys(snippet) if not known_key(key)]
    assert not unknown, f"keys the schema does not have: {unknown}"
    if fence.skip is None:
        refusals = loads_in_a_shipped_topology(snippet, tmp_path)
        assert not refusals, f"no shipped topology takes it; tiny.yaml's refusal: {refusals[0]}"


def test_every_skip_marker_stands_above_a_yaml_block_and_says_why():
    marked = sum(len(SKIP.findall(prose(page))) for page in PAGES)  # a marker is prose: an HTML comment
    reasons = [fence.skip for fence in yaml_fences() if fence.skip is not None]
    assert len(reasons) == marked and all(reason.strip() for reason in reasons)


ROW = re.compile(r"^\|\s*(?:`([\w/]+/)`)?\s*\|\s*(.*?)\s*\|$")
NAMED = re.compile(r"`([\w/]+(?:\.py|/))`")


def layout_named() -> set[str]:
    """The paths the layout table of docs/extending.md names: each row's folder, and the modules and folders its
    text names in backticks, relative to that folder (a row without a folder goes on with the one above)."""
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    section = text.split("## Layout and extending\n", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    folder = ""
    for line in section.splitlines():
        if row := ROW.match(line):
            folder = row[1] or folder
            named |= {folder, *(folder + name for name in NAMED.findall(row[2]))}
    return named


def layout_expected() -> set[str]:
    """What the table must name: actors/ and mesh/, the modules at their top, each room, the modules in each room
    and the packages within one (a package's own modules are its ``__init__``'s to describe)."""
    expected: set[str] = set()
    for top in ("actors", "mesh"):
        expected.add(f"{top}/")
        for room in (ROOT / top).iterdir():
            expected |= _named_in(room, top)
            if (room / "__init__.py").is_file():
                expected |= {name for inner in room.iterdir() for name in _named_in(inner, f"{top}/{room.name}")}
    return expected


def _named_in(path: Path, folder: str) -> set[str]:
    if path.suffix == ".py" and path.name != "__init__.py":
        return {f"{folder}/{path.name}"}
    return {f"{folder}/{path.name}/"} if (path / "__init__.py").is_file() else set()


def test_the_layout_table_names_every_module_and_room_and_only_what_exists():
    named = layout_named()
    assert sorted(layout_expected() - named) == [], "docs/extending.md's layout table leaves these out"
    assert sorted(path for path in named if not (ROOT / path).exists()) == [], "the layout table names no such path"
