"""``losses`` is pure tensor math: importing it pulls in no model, trainer or actor library."""

import subprocess
import sys


def test_losses_imports_only_torch():
    code = (
        "import sys, losses, losses.prime_rl;"
        "banned = [m for m in ('transformers', 'trl', 'monarch', 'mesh', 'actors', 'torchtitan', 'prime_rl')"
        " if m in sys.modules]; print(banned)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_actors_never_import_the_orchestrator():
    """``mesh`` imports ``actors``, never the reverse: every actor module loads without ``mesh``."""
    code = (
        "import sys, pkgutil, importlib, actors;"
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(actors.__path__, 'actors.')];"
        "print([m for m in sys.modules if m == 'mesh' or m.startswith('mesh.')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
