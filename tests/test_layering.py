"""The layers import downward only: ``mesh`` -> ``actors`` -> ``losses`` -> torch; within ``actors`` its rooms
do too (``ROOMS``); and no module imports one that imports it back."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(statement: str, banned: tuple[str, ...]) -> list[str]:
    """Which of ``banned`` (packages and their submodules) a fresh interpreter holds after ``statement``."""
    code = f"{statement}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & set({banned!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_losses_imports_only_torch():
    banned = ("transformers", "trl", "monarch", "mesh", "actors", "torchtitan", "prime_rl")
    assert loaded_after("import losses, losses.prime_rl", banned) == []


def test_actors_never_import_the_orchestrator():
    graph = import_graph(ROOT, ("losses", "actors", "mesh"))  # every import, deferred ones included
    actors = [name for name in graph if name.startswith("actors")]
    upward = sorted(f"{name} -> {up}" for name in actors for up in graph[name] if up.startswith("mesh"))
    assert upward == []


HEAVY = (
    "torch",
    "numpy",
    "monarch",
    "transformers",
    "trl",
    "vllm",
    "torchtitan",
    "wandb",
    "trackio",
    "datasets",
    "pyarrow",
    "tokenizers",
    "openenv",
)
CHECKED = [  # every shipped topology, and the backends a --set can name where the topology allows them
    ("tiny.yaml", []),
    ("tiny_distill.yaml", []),
    ("tiny_copies.yaml", []),
    ("tiny_vllm.yaml", []),
    ("tiny_diloco.yaml", []),
    ("math_small.yaml", []),
    ("math_small.yaml", ["model.init.tokenizer=chars"]),
    ("smol_math.yaml", []),  # a GGUF model: its header read in pure Python, nothing converted
    ("env_multiturn.yaml", []),
    ("agent_tools.yaml", []),  # the agent and its python tool are found, not run
    ("smol_tools.yaml", []),  # a GGUF model and an agent with demonstrations: found, none run
    ("tiny_diloco.yaml", ["diloco.transport=object_store", "diloco.store=s3://bucket/run", "diloco.replica=1"]),
    ("tiny.yaml", ["actors.trainer.inner_loop=trl"]),
    ("tiny.yaml", ["actors.trainer.inner_loop=torchtitan"]),
    ("tiny.yaml", ["actors.trainer.inner_loop=prime_rl"]),
    ("tiny.yaml", ["actors.generator.engine=vllm", "model.init.hidden_size=128"]),
    ("tiny.yaml", ["launcher.kind=slurm"]),
    ("tiny.yaml", ["launcher.kind=k8s"]),
    ("tiny.yaml", ["logging.wandb.project=p", "logging.trackio.project=p"]),  # found installed, not imported
    ("gpu_1gpu.yaml", []),
    ("gpu_node.yaml", []),
    ("tiny_lora.yaml", []),  # LoRA's checks (target modules, the adapters' shapes) read the model's files only
    ("gpu_lora.yaml", []),
]


def test_every_shipped_topology_is_checked_without_importing_a_backend():
    """All of them in one interpreter, each check then what it loaded: nothing heavy may load at any point, so the
    first check that loads a backend is the one named (and one interpreter start serves them all)."""
    topologies = Path(__file__).resolve().parents[1] / "topologies"
    assert {name for name, _ in CHECKED} == {p.name for p in topologies.glob("*.yaml")}
    checks = "".join(
        # GPU ones as on a GPU machine
        f"describe(load_plan({str(topologies / name)!r}, {overrides!r}, placed_here={not name.startswith('gpu')}))\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        f"assert not heavy, ({name!r}, {overrides!r}, heavy)\n"
        for name, overrides in CHECKED
    )
    imports = "import sys\nfrom mesh.topology.describe import describe\nfrom mesh.topology.preflight import load_plan\n"
    assert loaded_after(imports + checks, HEAVY) == []


def test_the_dry_run_command_imports_no_backend():
    tiny = Path(__file__).resolve().parents[1] / "topologies" / "tiny.yaml"
    statement = f"from mesh.run import main\nassert main([{str(tiny)!r}, '--dry-run']) == 0"
    assert loaded_after(statement, HEAVY) == []


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports, read from the source.

    Every import statement counts: at module level, under ``if TYPE_CHECKING:`` (a circle closed by a type-only
    import is still two modules that need each other) and inside functions (a deferred import only hides a
    circle). Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``, so it counts as importing them too,
    except the packages holding the importer, which are loading already. Not an import: a backend named by an
    import path string (``actors/registry.py``), the plugin boundary through which user code is found too.
    """
    files = {_module_name(path.relative_to(root)): path for p in packages for path in (root / p).rglob("*.py")}
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + [base] * bool(base))
            # ``from a import b`` imports module a.b if there is one, else a name of module a
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    found |= {parent for module in found for parent in _packages_of(module)}
    return {module for module in found if module in modules} - {name} - set(_packages_of(name))


def _packages_of(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected parts of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            part = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(part) > 1:
                found.append(sorted(part))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph(ROOT, ("losses", "actors", "mesh"))
    found = circles(graph)
    described = [[f"{a} -> {b}" for a in part for b in sorted(graph[a]) if b in part] for part in found]
    assert found == [], f"import circles (module -> what it imports): {described}"


PROGRAMS = ("mesh.run", "mesh.ctl", "mesh.export", "mesh.report", "mesh.reference")  # python -m <program>


def test_the_command_line_programs_sit_at_the_top_and_no_module_imports_one():
    graph = import_graph(ROOT, ("losses", "actors", "mesh"))
    at_top = {f"mesh.{path.stem}" for path in (ROOT / "mesh").glob("*.py") if path.stem != "__init__"}
    assert at_top == set(PROGRAMS), "mesh/ holds the programs; library code goes in one of its rooms"
    importers = sorted(f"{name} -> {program}" for name, imported in graph.items() for program in imported & at_top)
    assert importers == [], "library code imports a command-line program: move what it needs into a room"


def test_circles_closed_by_type_only_deferred_or_package_imports_are_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("from pkg import a\n\ndef later():\n    from pkg.c import C\n")
    (package / "c.py").write_text("from . import b\nfrom pkg.sub.d import D\n")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.e import E\n")
    (package / "sub" / "d.py").write_text("from .e import E\n")  # its own package is loading already
    (package / "sub" / "e.py").write_text("from pkg import c\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a", "pkg.c"},
        "pkg.c": {"pkg.b", "pkg.sub", "pkg.sub.d"},
        "pkg.sub": {"pkg.sub.e"},
        "pkg.sub.d": {"pkg.sub.e"},
        "pkg.sub.e": {"pkg.c"},
    }
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub", "pkg.sub.d", "pkg.sub.e"]]


ROOMS = (  # actors/'s rooms, bottom to top: each imports only rooms before it (actors/__init__.py draws them)
    "basics",
    "registry",
    "tasks",
    "models",
    "contract",
    "weights",
    "sandbox",
    "agents",
    "environments",
    "teachers",
    "rewarder",
    "generator",
    "inner_loops",
    "reference_model",
    "diloco",
    "trainer",
)
ROOT_MODULES = 8  # at most, beside actors/'s packages: shared code belongs in a room


def test_actors_rooms_import_downward_only():
    graph = import_graph(ROOT, ("actors",))
    rooms = {name.split(".")[1] for name in graph if "." in name}
    assert rooms == set(ROOMS), "a room of actors/ goes in ROOMS, and in actors/__init__.py's map"
    rank = {room: i for i, room in enumerate(ROOMS)}
    upward = sorted(
        f"{name} -> {imported}"
        for name, modules in graph.items()
        if "." in name
        for imported in modules
        if "." in imported and rank[imported.split(".")[1]] > rank[name.split(".")[1]]
    )
    assert upward == [], "a room imports one above it: move the shared piece down, or the room up"


def test_actors_root_holds_its_rooms_and_few_modules():
    import actors

    modules = sorted(path.name for path in (ROOT / "actors").glob("*.py") if path.name != "__init__.py")
    assert len(modules) <= ROOT_MODULES, f"actors/ holds {modules}: move them into rooms"
    drawn = set(re.findall(r"^    (\w+)/ ", actors.__doc__, re.M))
    assert drawn == {room for room in ROOMS if (ROOT / "actors" / room).is_dir()}, "actors/__init__.py's map"


def test_no_package_init_of_actors_imports_a_heavy_library():
    """Each package's ``__init__`` in one interpreter, the heavy libraries checked after each: importing a package
    for its config must not load a backend."""
    packages = sorted(_module_name(path.relative_to(ROOT)) for path in (ROOT / "actors").rglob("__init__.py"))
    checks = "".join(
        f"import {package}\nassert not {{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}), {package!r}\n"
        for package in packages
    )
    assert loaded_after("import sys\n" + checks, HEAVY) == []


MESH_ROOMS = (  # mesh/'s rooms, bottom to top: each imports only rooms before it (mesh/__init__.py draws them)
    "topology",
    "launchers",
    "records",
    "supervision",
    "controller",
    "checkpoints",
    "runtime",
)


def test_mesh_rooms_import_downward_only():
    """A room is a package of mesh/; a module directly under it (a program, or mesh/__init__.py) is in none."""
    import mesh

    graph = import_graph(ROOT, ("mesh",))
    rooms_of = {name: name.split(".")[1] for name in graph if "." in name}
    in_rooms = {name: room for name, room in rooms_of.items() if (ROOT / "mesh" / room).is_dir()}  # not a program
    assert set(in_rooms.values()) == set(MESH_ROOMS), "a room of mesh/ goes in MESH_ROOMS, and in mesh/__init__.py"
    drawn = re.findall(r"^    (\w+)/ ", mesh.__doc__, re.M)
    assert drawn == list(reversed(MESH_ROOMS)), "mesh/__init__.py's map draws the rooms top to bottom"
    rank = {room: i for i, room in enumerate(MESH_ROOMS)}
    upward = sorted(
        f"{name} -> {imported}"
        for name, room in in_rooms.items()
        for imported in graph[name]
        if imported in in_rooms and rank[in_rooms[imported]] > rank[room]
    )
    assert upward == [], "a room imports one above it: move the shared piece down, or the room up"
