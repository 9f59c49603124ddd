"""The layers import downward only: ``mesh`` -> ``actors`` -> ``losses`` -> torch; and within them, no
module imports one that imports it back."""

import ast
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
    every_actor_module = (
        "import importlib, pkgutil, actors\n"
        "for m in pkgutil.walk_packages(actors.__path__, 'actors.'): importlib.import_module(m.name)"
    )
    assert loaded_after(every_actor_module, ("mesh",)) == []


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
    topologies = Path(__file__).resolve().parents[1] / "topologies"
    assert {name for name, _ in CHECKED} == {p.name for p in topologies.glob("*.yaml")}
    for name, overrides in CHECKED:
        statement = (
            "from mesh.describe import describe\nfrom mesh.preflight import load_plan\n"  # GPU ones as on a GPU machine
            f"describe(load_plan({str(topologies / name)!r}, {overrides!r}, placed_here={not name.startswith('gpu')}))"
        )
        assert loaded_after(statement, HEAVY) == [], (name, overrides)


def test_the_dry_run_command_imports_no_backend():
    tiny = Path(__file__).resolve().parents[1] / "topologies" / "tiny.yaml"
    statement = f"from mesh.run import main\nassert main([{str(tiny)!r}, '--dry-run']) == 0"
    assert loaded_after(statement, HEAVY) == []


# Circles closed by type-only imports of the Topology, and the controller's Collected, which the issue-29 RunPlan
# split removes; each entry is the edge that closes one. An entry whose import is gone must leave this list.
ALLOWED_CIRCLE_EDGES = {
    # type-only: a launcher's options are a section of the topology and check and describe the plan made from
    # it, one class per launcher holding both (config beside its code); nothing imports the other at run time
    ("mesh.launchers", "mesh.plan"),
}


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports where it is defined, read from the source.

    Counted: every import outside a function, ``if TYPE_CHECKING:`` ones included (a circle closed
    by a type-only import is still two modules that need each other). Not counted: an import inside
    a function, which runs when the function is called, after both modules have loaded: that is how
    a module reached when a topology is read starts its run-time code without loading it (as the
    registry's import paths do), e.g. ``K8sOptions.launcher``.
    """
    files = {_module_name(path.relative_to(root)): path for p in packages for path in (root / p).rglob("*.py")}
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module
                package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(package + [base] * bool(base))
            # ``from a import b`` imports module a.b if there is one, else a name of module a
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            pending.extend(ast.iter_child_nodes(node))
    return {module for module in found if module in modules} - {name}


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
    gone = sorted(edge for edge in ALLOWED_CIRCLE_EDGES if edge[1] not in graph.get(edge[0], set()))
    assert not gone, f"{gone} no longer import(s) that module: remove it from ALLOWED_CIRCLE_EDGES"
    allowed = {a: imported - {b for edge_a, b in ALLOWED_CIRCLE_EDGES if edge_a == a} for a, imported in graph.items()}
    found = circles(allowed)
    described = [[f"{a} -> {b}" for a in part for b in sorted(allowed[a]) if b in part] for part in found]
    assert found == [], f"import circles (module -> what it imports): {described}"


def test_a_circle_closed_by_a_type_only_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (package / "b.py").write_text("from pkg import a\n\ndef later():\n    from pkg.c import C\n")
    (package / "c.py").write_text("from . import b\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert circles(graph) == [["pkg.a", "pkg.b"]]
