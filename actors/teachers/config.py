"""The TeacherPool's config and the rules about which bindings may serve which loss channel (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.teachers.bindings.config import BindingConfig
from losses.config import LossConfig


@dataclass(frozen=True)
class TeachersConfig:
    mesh: str  # the mesh the TeacherPool runs on
    bindings: dict[str, BindingConfig] = field(default_factory=dict)  # by name; mesh.ctl changes them live

    def __post_init__(self) -> None:
        check_one_distill(self.bindings)


def check_one_distill(bindings: dict[str, BindingConfig]) -> None:
    distill = sorted(name for name, b in bindings.items() if "distill" in b.use)
    if len(distill) > 1:
        raise ValueError(
            f"teachers {distill} are all used for distill, but channel 2 distils from one teacher at a time; "
            "keep 'distill' in one binding's use (in a live run: bind the new teacher under the old one's name, "
            "which replaces it, or unbind the old one first)"
        )


def check_weighted(name: str, cfg: BindingConfig, loss: LossConfig) -> None:
    """A teacher for a channel whose loss weight is 0 would change nothing: a mistake, refused."""
    knob = {"distill": "alpha_sdpo", "replay": "beta_replay"}
    for use in cfg.use:
        if getattr(loss, knob[use]) <= 0:
            raise ValueError(
                f"teacher {name!r} is for {use}, but this run's loss.{knob[use]} is 0, so it would change nothing; "
                f"set actors.trainer.loss.{knob[use]} > 0 or drop {use!r} from its use"
            )
