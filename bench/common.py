"""What every benchmark prints first: the machine it ran on."""

from __future__ import annotations

import os
import platform
import re
import subprocess


def machine() -> str:
    import torch

    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s+(.+)", out).group(1).strip()
    except (OSError, AttributeError):
        pass
    return f"{os.cpu_count()}-core CPU ({model}), torch {torch.__version__}, {torch.get_num_threads()} threads"
