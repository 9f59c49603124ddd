"""The layers import downward only: ``mesh`` -> ``actors`` -> ``losses`` -> torch."""

import ast
import subprocess
import sys


def loaded_after(statement: str, banned: tuple[str, ...]) -> list[str]:
    """Which of ``banned`` (packages and their submodules) a fresh interpreter holds after ``statement``."""
    code = (
        f"{statement}\nimport sys\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({banned!r})))"
    )
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
