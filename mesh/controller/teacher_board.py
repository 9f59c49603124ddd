"""The controller's view of the TeacherPool: which binding serves which channel, now.

The view changes only at step boundaries, when ``mesh.ctl`` commands are applied. A
collection takes a snapshot when it starts and uses those bindings to its end, so a
rebind never changes a batch half-way; the pool drops an old binding once no
collection in flight can still use it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

from actors.teachers.bindings.config import BindingConfig
from actors.teachers.config import check_one_distill, check_weighted
from losses.config import LossConfig

if TYPE_CHECKING:
    from monarch._src.actor.actor_mesh import ActorMesh

    from mesh.supervision.commands import Command


@dataclass(frozen=True)
class TeacherBinding:
    name: str
    binding_id: str  # the pool's id of this build of it
    config: BindingConfig
    bound_at_step: int
    needs_hint: bool  # as the pool found it: the controller never loads a binding's code


Snapshot = dict[str, TeacherBinding]


class TeacherBoard:
    """Which binding serves which channel; it names every build of a binding (``name#n``)."""

    def __init__(self, configs: dict[str, BindingConfig], loss: LossConfig):
        self.pool: ActorMesh | None = None  # attached once the pool has started with ``live()``
        self.loss = loss
        self.built = 0
        self.bound = {name: TeacherBinding(name, self._next_id(name), cfg, 0, False) for name, cfg in configs.items()}
        self.retiring: list[tuple[TeacherBinding, int]] = []  # (binding, the first step that no longer uses it)

    def live(self) -> dict[str, BindingConfig]:
        """Every binding a collection may still call, by id: what a (re)started pool must build."""
        return {b.binding_id: b.config for b in [*self.bound.values(), *(b for b, _ in self.retiring)]}

    async def attach(self, pool: ActorMesh) -> None:
        """The started pool: learn from it which bindings read hints."""
        self.pool = pool
        hints = await pool.needs_hints.call_one()
        self.bound = {name: replace(b, needs_hint=hints[b.binding_id]) for name, b in self.bound.items()}

    def _next_id(self, name: str) -> str:
        self.built += 1
        return f"{name}#{self.built}"

    def snapshot(self) -> Snapshot:
        return dict(self.bound)

    def view(self) -> dict[str, dict]:
        """What ``mesh.ctl teachers list`` shows (``teachers.json``)."""
        return {
            name: {"spec": _spec(b.config), "bound_at_step": b.bound_at_step, "binding_id": b.binding_id}
            for name, b in self.bound.items()
        }

    async def apply(self, command: Command, step: int) -> tuple[bool, str]:
        """Apply one ``bind``/``unbind`` from ``step`` on; (applied, message). A refused command changes nothing."""
        if self.pool is None:
            return False, (
                "this run has no TeacherPool (its topology has no actors.teachers section), so there is nothing "
                "to bind into; add an actors.teachers section and start the run again"
            )
        name = command.args.get("name")
        if command.verb == "unbind":
            if name not in self.bound:
                return False, f"no teacher is bound as {name!r}; bound: {sorted(self.bound)}"
            self._retire(self.bound.pop(name), step)
            return True, f"unbound teacher {name!r}; it is not used from step {step}"
        if command.verb != "bind":
            return False, f"unknown command {command.verb!r}; use bind or unbind"
        try:  # names, registry metadata and import finders only: the pool alone runs a binding's code
            cfg = BindingConfig(**command.args["spec"])
            check_one_distill({n: b.config for n, b in self.bound.items() if n != name} | {name: cfg})
            check_weighted(name, cfg, self.loss)
        except (TypeError, ValueError) as error:
            return False, f"{error}; teacher {name!r} is unchanged"
        bound = await self.pool.bind.call_one(self._next_id(name), cfg)
        if bound.error is not None:
            return False, f"the pool could not build teacher {name!r}: {bound.error}; the old binding stays"
        if name in self.bound:
            self._retire(self.bound[name], step)
        self.bound[name] = TeacherBinding(name, bound.binding_id, cfg, step, bound.needs_hint)
        uses = ", ".join(cfg.use) or "no channel"
        return True, f"bound teacher {name!r} ({cfg.kind}, for {uses}); it applies from step {step}"

    async def drop_retired(self, step: int) -> None:
        """Drop the bindings that no collection from ``step`` on can use."""
        keep = []
        for binding, until in self.retiring:
            if until <= step:
                await self.pool.drop.call_one(binding.binding_id)
            else:
                keep.append((binding, until))
        self.retiring = keep

    def _retire(self, binding: TeacherBinding, step: int) -> None:
        self.retiring.append((binding, step))


def _spec(cfg: BindingConfig) -> dict:
    """The config as a user would write it: the fields that differ from their defaults."""
    defaults = {f.name: f.default for f in fields(BindingConfig)}
    spec = {k: v for k, v in asdict(cfg).items() if v != defaults[k]}
    return spec | ({"use": list(cfg.use)} if cfg.use else {})
