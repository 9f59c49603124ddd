"""The layers import downward only: ``mesh`` -> ``actors`` -> ``losses`` -> torch."""

import ast
import subprocess
import sys
from pathlib import Path


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
    ("env_multiturn.yaml", []),
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
