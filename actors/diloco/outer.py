"""DiLoCo's outer step on a set of live parameters: θ₀, the outer optimizer and the rounds taken.

Kept apart from the actor (``syncer.py``) so the arithmetic can be checked on its own against
data-parallel training, with no mesh around it.

    Δ = θ₀ − θ                      (the pseudo-gradient: where the inner steps moved, reversed)
    θ₀ ← outer optimizer step on θ₀ with gradient mean(Δ)
    θ ← θ₀

With outer SGD at lr 1 and no momentum, θ becomes the mean of the replicas' parameters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.diloco.config import OuterOptimizerConfig


class OuterLoop:
    """θ₀ in float32 and its optimizer, for ``params``: tensors changed in place (a trainer's)."""

    def __init__(self, params: dict[str, Tensor], cfg: OuterOptimizerConfig):
        self.params = params
        self.global_params = {n: v.detach().float().clone() for n, v in params.items()}
        self.optimizer = torch.optim.SGD(
            list(self.global_params.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
        )
        self.rounds = 0  # outer steps taken

    def pseudo_gradient(self) -> dict[str, Tensor]:
        return {n: self.global_params[n] - v.detach().float() for n, v in self.params.items()}

    def step(self, mean: dict[str, Tensor]) -> None:
        """Step θ₀ with the replicas' mean pseudo-gradient and load it into the live parameters."""
        for name, param in self.global_params.items():
            param.grad = mean[name].to(param.device, param.dtype, copy=True)  # SGD may change it in place
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, values in self.params.items():
                values.copy_(self.global_params[name])
        self.rounds += 1

    def state_dict(self) -> dict:
        """θ₀, the outer optimizer's state and the rounds taken (what a checkpoint or a heal carries)."""
        return {"rounds": self.rounds, "global": self.global_params, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Adopt ``state`` (the live parameters change at the next ``step``)."""
        with torch.no_grad():
            for name, param in self.global_params.items():
                param.copy_(state["global"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rounds = state["rounds"]
