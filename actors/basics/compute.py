"""What one actor computes with: its CPU threads, its GPUs and its share of their memory.

``mesh/topology/gpus.py`` decides, for the whole topology, which GPUs each process sees and
what share of their memory each actor may take; this module holds the result one actor
receives. It is named after what it holds, not ``placement.py``, so that the deciding
module and the decided record are not two modules of one name in two layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Compute:
    """What one actor's process computes with: its CPU threads, and the GPUs it sees. The launcher
    starts each process seeing exactly its GPUs (``mesh/topology/gpus.py``), so they are always
    ``cuda:0`` .. ``cuda:gpus-1`` here. ``memory_share``: the share of each GPU's memory the
    actor may take when another process holds the rest (None: all of it)."""

    threads: int = 1
    gpus: int = 0
    memory_share: float | None = None

    def device(self) -> torch.device:
        """The process's first GPU, made the current CUDA device; or the CPU."""
        if not self.gpus:
            return torch.device("cpu")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        return device
