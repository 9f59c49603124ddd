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
