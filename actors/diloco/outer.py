"""DiLoCo's outer step on a set of live parameters: θ₀, the outer optimizer and the rounds taken.

Kept apart from the actor (``syncer.py``) so the arithmetic can be checked on its own against
data-parallel training, with no mesh around it.

    Δ = θ₀ − θ                      (the pseudo-gradient: where the inner steps moved, reversed)
    θ₀ ← outer optimizer step on θ₀ with gradient mean(Δ)
    θ ← θ₀

With outer SGD at lr 1 and no momentum, θ becomes the mean of the replicas' parameters.

Streaming DiLoCo (``fragments`` > 1) cuts the parameters into contiguous fragments and each round
syncs one of them, in turn: the same bytes per fragment, spread over the interval instead of one
burst. A parameter outside the round's fragment keeps training, and its θ₀ and momentum wait for
its own round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.diloco.config import OuterOptimizerConfig


def fragments_of(names: list[str], count: int) -> list[list[str]]:
    """A model's parameter names, in order, cut into ``count`` contiguous fragments of as equal numbers of
    tensors as can be (layers, for a decoder); by count, not size, so every rank of an FSDP2 trainer,
    whose shards differ in size, cuts the same."""
    if not 1 <= count <= len(names):
        raise ValueError(
            f"diloco.fragments is {count}, but the trainer has {len(names)} parameter tensors to cut into "
            f"fragments; use at most {len(names)}"
        )
    bounds = [round(i * len(names) / count) for i in range(count + 1)]
    return [names[bounds[i] : bounds[i + 1]] for i in range(count)]


class OuterLoop:
    """θ₀ in float32 and its optimizer, for ``params``: tensors changed in place (a trainer's)."""

    def __init__(self, params: dict[str, Tensor], cfg: OuterOptimizerConfig, fragments: int = 1):
        self.params = params
        self.fragments = fragments_of(list(params), fragments)
        self.global_params = {n: v.detach().float().clone() for n, v in params.items()}
        self.optimizer = torch.optim.SGD(
            list(self.global_params.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
        )
        self.rounds = 0  # outer steps taken

    def fragment(self, round: int) -> list[str]:
        """The parameters ``round`` syncs (all of them, without streaming)."""
        return self.fragments[(round - 1) % len(self.fragments)]

    def pseudo_gradient(self) -> dict[str, Tensor]:
        """Δ of the next round's fragment."""
        return {n: self.global_params[n] - self.params[n].detach().float() for n in self.fragment(self.rounds + 1)}

    def step(self, mean: dict[str, Tensor]) -> None:
        """Step θ₀ of ``mean``'s parameters with the replicas' mean pseudo-gradient (SGD leaves the others,
        which have no gradient, as they are) and load it into those live parameters."""
        for name, delta in mean.items():
            param = self.global_params[name]
            param.grad = delta.to(param.device, param.dtype, copy=True)  # SGD may change it in place
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name in mean:
                self.params[name].copy_(self.global_params[name])
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
