"""DiLoCo's outer step (``actors/diloco/outer.py``) checked against arithmetic it must reproduce.

What is checked, and why each check can fail:

- DP equivalence: with outer SGD at lr 1 and no momentum, one plain inner SGD step per round on
  each replica, and the pseudo-gradients averaged through a real object-store transport (a
  ``file://`` store, replicas as threads), DiLoCo *is* data-parallel SGD on the union of the
  replicas' batches: mean(η∇L_i) = η∇mean(L_i). A tiny random-init Qwen2 trained both ways must
  agree to fp32 rounding over several rounds, and the replicas must hold bit-identical weights
  after every sync. A wrong sign, a sum instead of a mean, a missing copy into the live weights or
  a stale θ₀ breaks it; the check also asserts that a replica alone (before the sync) is far from
  the DP weights, so the agreement really comes from the averaging.
- Sign convention: Δ = θ₀ − θ. An outer lr-1 step on a lone replica's Δ lands θ₀ on θ, lr 0.5
  halfway; the flipped sign is shown to land on the mirror image, away from θ.
- Nesterov momentum: the outer optimizer's state carries across rounds (matches
  ``torch.optim.SGD(nesterov=True)`` and the update written out by hand, differs from a
  memoryless optimizer), and ``state_dict``/``load_state_dict`` through ``torch.save`` resumes
  bit-identically (and θ₀ alone, without the momentum, would not).
- Replay: a replica that missed rounds (absent, or restarted from an older checkpoint) and replays
  them with ``transport.mean_of(k)``, as the syncer's catch-up does, ends bit-identical to a replica
  that took part: θ₀, momentum buffers, rounds and live parameters.

Everything is real (HF model, torch optimizers, the object-store transport on a directory); the
file takes about 10 s on two cores, half of it importing transformers.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
import transformers

from actors.diloco.config import OuterOptimizerConfig
from actors.diloco.object_store import ObjectStoreTransport
from actors.diloco.outer import OuterLoop, fragments_of
from actors.models.facts import TinyModelSpec
from actors.models.tiny import causal_lm

POLL = 0.05
VOCAB, SEQ, PER_REPLICA = 48, 8, 2  # token ids, sequence length, sequences in each replica's batch
INNER_LR = 0.1
PLAIN = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False)
NESTEROV = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)

Params = dict[str, torch.Tensor]


# --- helpers ----------------------------------------------------------------------------------


def tiny_model(seed: int = 0) -> transformers.PreTrainedModel:
    """The project's random-init two-layer Qwen2 at hidden 32, float32, in training mode."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = causal_lm(TinyModelSpec(hidden_size=32, intermediate_size=64), VOCAB)
    return model.float().train()


def next_token_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence (no padding)."""
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(seed: int, replicas: int) -> list[torch.Tensor]:
    """One equal-size batch of random token sequences per replica."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (PER_REPLICA, SEQ), generator=g) for _ in range(replicas)]


def sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    next_token_loss(model, tokens).backward()
    optimizer.step()


def live(model: torch.nn.Module) -> Params:
    """The model's parameters by name: the tensors OuterLoop changes in place."""
    return dict(model.named_parameters())


def snapshot(params: Params) -> Params:
    return {n: t.detach().clone() for n, t in params.items()}


def momentum_buffers(loop: OuterLoop) -> list[torch.Tensor]:
    return [loop.optimizer.state[p]["momentum_buffer"] for p in loop.global_params.values()]


def assert_equal(got: Params, want: Params) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        assert torch.equal(got[name].detach(), expected.detach()), name


def max_diff(a: Params, b: Params) -> float:
    return max((a[n].detach() - b[n].detach()).abs().max().item() for n in a)


def transport(tmp_path, replicas: int, replica: int, round_timeout: float = 10.0) -> ObjectStoreTransport:
    return ObjectStoreTransport(f"file://{tmp_path}/store", replicas, replica, round_timeout=round_timeout, poll_s=POLL)


def in_threads(work: dict[int, Callable[[], object]]) -> dict[int, object]:
    """Run each replica's ``work`` at once, one thread each (errors reraised here)."""
    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        futures = {i: pool.submit(fn) for i, fn in work.items()}
        return {i: f.result(timeout=60) for i, f in futures.items()}


class Replica:
    """A replica: its model copy, inner SGD, OuterLoop and transport."""

    def __init__(self, model, cfg: OuterOptimizerConfig, transport: ObjectStoreTransport):
        self.model = model
        self.inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        self.outer = OuterLoop(live(model), cfg)
        self.transport = transport

    def round(self, tokens: list[torch.Tensor]) -> tuple[tuple[int, ...], Params]:
        """Inner steps on ``tokens``, then one sync: the members averaged and the weights before it."""
        for batch in tokens:
            sgd_step(self.model, self.inner, batch)
        before = snapshot(live(self.model))
        result = self.transport.average(self.outer.rounds + 1, self.outer.pseudo_gradient())
        self.outer.step(result.mean)
        return result.members, before


# --- 1. DP equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 3])
def test_outer_sgd_lr1_equals_data_parallel_sgd(tmp_path, replicas: int) -> None:
    base = tiny_model()
    initial = snapshot(live(base))
    reference = copy.deepcopy(base)  # one copy trained data-parallel on the union of the batches
    reference_sgd = torch.optim.SGD(reference.parameters(), lr=INNER_LR)
    group = [Replica(copy.deepcopy(base), PLAIN, transport(tmp_path, replicas, i)) for i in range(replicas)]

    for round in (1, 2, 3):
        data = batches(seed=round, replicas=replicas)
        results = in_threads({i: (lambda r=r, b=data[i]: r.round([b])) for i, r in enumerate(group)})
        sgd_step(reference, reference_sgd, torch.cat(data))
        dp = live(reference)

        for i, (members, before) in results.items():
            assert members == tuple(range(replicas)), (round, i)
            # alone, a replica's step is far from the DP step: the agreement below is the averaging's
            assert max_diff(before, dp) > 1e-3, (round, i)
        for r in group[1:]:  # every replica holds the same bits after the sync
            assert_equal(live(r.model), live(group[0].model))
        assert_equal(group[0].outer.global_params, live(group[0].model))  # θ ← θ₀
        assert group[0].outer.rounds == round
        torch.testing.assert_close(snapshot(live(group[0].model)), snapshot(dp), atol=1e-6, rtol=0)

    assert max_diff(initial, live(reference)) > 1e-3  # training moved the weights: the check has teeth


# --- 2. sign convention -----------------------------------------------------------------------


def dyadic(seed: int, shape: tuple[int, ...], scale: int) -> torch.Tensor:
    """Small multiples of 1/scale: their sums and halves are exact in float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, shape, generator=g).float() / scale


@pytest.mark.parametrize("lr, fraction", [(1.0, 1.0), (0.5, 0.5)])
def test_pseudo_gradient_points_back_and_the_step_moves_forward(lr: float, fraction: float) -> None:
    theta0 = {"w": dyadic(0, (4, 3), 4), "b": dyadic(1, (3,), 4)}
    d = {"w": dyadic(2, (4, 3), 8), "b": dyadic(3, (3,), 8)}
    params = snapshot(theta0)
    loop = OuterLoop(params, OuterOptimizerConfig(lr=lr, momentum=0.0, nesterov=False))
    with torch.no_grad():  # an inner step that moves θ by +d
        for n in params:
            params[n].add_(d[n])
    theta = snapshot(params)

    delta = loop.pseudo_gradient()
    assert_equal(delta, {n: -d[n] for n in d})  # Δ = θ₀ − θ = −d
    assert_equal(loop.global_params, theta0)  # θ₀ is untouched by the inner step

    lone = ObjectStoreTransport("file:///unused", 1, 0).average(1, delta)  # a world of one passes through
    assert lone.members == (0,)
    assert_equal(lone.mean, delta)
    loop.step(lone.mean)

    landed = {n: theta0[n] + fraction * d[n] for n in d}  # lr 1: on θ; lr 0.5: halfway
    assert_equal(loop.global_params, landed)
    assert_equal(params, landed)
    assert loop.rounds == 1
    if lr == 1.0:
        assert_equal(params, theta)

    # the flipped convention (Δ = θ − θ₀) would step away from where the replica went, not towards it
    flipped = OuterLoop(snapshot(theta0), OuterOptimizerConfig(lr=lr, momentum=0.0, nesterov=False))
    flipped.step({n: theta[n] - theta0[n] for n in theta})  # θ − θ₀ = +d
    assert_equal(flipped.global_params, {n: theta0[n] - fraction * d[n] for n in d})
    assert max_diff(flipped.global_params, theta) > max_diff(theta0, theta)


# --- 3. Nesterov momentum and checkpoint/resume -----------------------------------------------


def inner_move(params: Params, round: int) -> None:
    """Stand-in for a round of inner steps: a seeded move of the live parameters."""
    g = torch.Generator().manual_seed(100 + round)
    with torch.no_grad():
        for t in params.values():
            t.add_(0.1 * torch.randn(t.shape, generator=g))


def start_params() -> Params:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g)}


def test_nesterov_outer_state_carries_across_rounds_and_resumes_bit_identically() -> None:
    params = start_params()
    loop = OuterLoop(params, NESTEROV)
    reference = snapshot(params)  # θ₀ stepped by torch's SGD directly
    reference_sgd = torch.optim.SGD(list(reference.values()), lr=0.7, momentum=0.9, nesterov=True)
    by_hand, buffers = snapshot(params), {}  # θ₀ stepped by the update written out
    checkpoint = None

    for round in (1, 2, 3, 4):
        inner_move(params, round)
        mean = loop.pseudo_gradient()  # a world of one: the mean is the lone Δ
        grads = snapshot(mean)
        memoryless = {n: loop.global_params[n] - 0.7 * 1.9 * grads[n] for n in grads}  # a fresh Nesterov SGD
        loop.step(mean)

        for n, t in reference.items():
            t.grad = grads[n].clone()
        reference_sgd.step()
        for n, g in grads.items():  # b ← μb + g (b₁ = g); θ₀ ← θ₀ − lr·(g + μb)
            buffers[n] = g.clone() if n not in buffers else buffers[n] * 0.9 + g
            by_hand[n] = by_hand[n] - 0.7 * (g + 0.9 * buffers[n])

        assert_equal(loop.global_params, reference)
        assert_equal(params, reference)
        torch.testing.assert_close(loop.global_params, by_hand, atol=1e-6, rtol=1e-6)
        for buffer, want in zip(momentum_buffers(loop), buffers.values(), strict=True):
            torch.testing.assert_close(buffer, want, atol=1e-6, rtol=1e-6)
        if round > 1:  # the momentum from earlier rounds changes the step
            assert max_diff(loop.global_params, memoryless) > 1e-2
        if round == 2:  # a checkpoint as the syncer writes one, and the trainer's own weights
            checkpoint = io.BytesIO()
            torch.save(loop.state_dict(), checkpoint)
            resumed_params = snapshot(params)

    assert loop.rounds == 4

    def resume(state: dict) -> tuple[OuterLoop, Params]:
        fresh = {n: torch.zeros_like(t) for n, t in resumed_params.items()}
        with torch.no_grad():
            for n, t in fresh.items():
                t.copy_(resumed_params[n])
        outer = OuterLoop(fresh, NESTEROV)
        outer.load_state_dict(state)
        for round in (3, 4):
            inner_move(fresh, round)
            outer.step(outer.pseudo_gradient())
        return outer, fresh

    checkpoint.seek(0)
    resumed, resumed_live = resume(torch.load(checkpoint, weights_only=True))
    assert resumed.rounds == 4
    assert_equal(resumed.global_params, loop.global_params)
    assert_equal(resumed_live, params)
    for got, want in zip(momentum_buffers(resumed), momentum_buffers(loop), strict=True):
        assert torch.equal(got, want)

    # θ₀ without the optimizer's state would not resume: the momentum is part of the checkpoint
    checkpoint.seek(0)
    state = torch.load(checkpoint, weights_only=True)
    state["optimizer"]["state"] = {}
    no_momentum, _ = resume(state)
    assert max_diff(no_momentum.global_params, loop.global_params) > 1e-2


# --- 4. replay equals taking part -------------------------------------------------------------


@pytest.mark.parametrize("missed", ["absent", "restarted"])
def test_replaying_closed_rounds_equals_taking_part(tmp_path, missed: str) -> None:
    """Replica 1 saves its state after round 1; rounds 2..3 then close without it (``absent``:
    replica 0 alone, at the round timeout) or with it (``restarted``: it crashed after them and
    came back from the round-1 checkpoint). Replaying 2..3 from the store must land it exactly where
    the replicas that took part are."""
    base = tiny_model(seed=1)
    a, b = (Replica(copy.deepcopy(base), NESTEROV, transport(tmp_path, 2, i)) for i in range(2))

    def both(round: int) -> dict[int, object]:
        data = batches(seed=10 * round, replicas=4)  # two inner steps per replica
        return in_threads({0: lambda: a.round(data[:2]), 1: lambda: b.round(data[2:])})

    assert all(members == (0, 1) for members, _ in both(1).values())
    checkpoint = io.BytesIO()
    torch.save(b.outer.state_dict(), checkpoint)
    b_weights = snapshot(live(b.model))  # the trainer's checkpoint beside the syncer's

    if missed == "absent":
        a.transport = transport(tmp_path, 2, 0, round_timeout=0.3)  # don't wait long for replica 1
        for round in (2, 3):
            members, _ = a.round(batches(seed=10 * round, replicas=2))
            assert members == (0,)
        took_part = a
    else:
        for round in (2, 3):
            assert all(members == (0, 1) for members, _ in both(round).values())
        assert_equal(b.outer.global_params, a.outer.global_params)
        took_part = b

    model = tiny_model(seed=2)  # a new process: other weights until the checkpoints are loaded
    with torch.no_grad():
        for n, t in live(model).items():
            t.copy_(b_weights[n])
    checkpoint.seek(0)
    back = Replica(model, NESTEROV, transport(tmp_path, 2, 1))
    back.outer.load_state_dict(torch.load(checkpoint, weights_only=True))
    assert back.outer.rounds == 1
    assert max_diff(back.outer.global_params, took_part.outer.global_params) > 1e-3  # behind, for now

    latest = back.transport.latest_round()
    assert latest == 3
    for round in range(back.outer.rounds + 1, latest + 1):  # the syncer's catch-up
        back.outer.step(back.transport.mean_of(round))

    assert back.outer.rounds == took_part.outer.rounds == 3
    assert_equal(back.outer.global_params, took_part.outer.global_params)
    for got, want in zip(momentum_buffers(back.outer), momentum_buffers(took_part.outer), strict=True):
        assert torch.equal(got, want)
    assert_equal(live(back.model), live(took_part.model))


# --- 5. streaming: one fragment per round -----------------------------------------------------


def test_fragments_are_contiguous_and_cut_the_same_on_every_rank() -> None:
    names = [f"layers.{i}.{p}" for i in range(3) for p in ("q", "k", "mlp")] + ["head"]
    cut = fragments_of(names, 3)
    assert [n for fragment in cut for n in fragment] == names and [len(f) for f in cut] == [3, 4, 3]
    assert fragments_of(names, 1) == [names]
    with pytest.raises(ValueError, match="at most 10"):
        fragments_of(names, 11)


def test_streaming_rounds_sync_one_fragment_each_in_turn_with_momentum_per_fragment() -> None:
    """Two replicas, two fragments ("w" then "b"), outer Nesterov SGD: a round steps only its fragment's
    θ₀ and live values, leaving the other fragment's training and momentum untouched until its turn."""
    replicas = [start_params(), start_params()]
    loops = [OuterLoop(p, NESTEROV, fragments=2) for p in replicas]
    means = {}
    for round in (1, 2, 3):
        for i, params in enumerate(replicas):
            inner_move(params, 10 * i + round)
        before = [snapshot(p) for p in replicas]
        deltas = [loop.pseudo_gradient() for loop in loops]
        assert all(list(d) == [["w"], ["b"]][(round - 1) % 2] for d in deltas)
        mean = means[round] = {n: (deltas[0][n] + deltas[1][n]) / 2 for n in deltas[0]}
        for loop in loops:
            loop.step(mean)
        (synced,) = mean
        (waiting,) = {"w", "b"} - {synced}
        assert torch.equal(replicas[0][synced], replicas[1][synced])
        for params, old in zip(replicas, before):
            assert torch.equal(params[waiting], old[waiting])  # the other fragment trains on, unsynced
        assert all(loop.rounds == round for loop in loops)
    # "w" synced in rounds 1 and 3, "b" in round 2: each fragment's momentum saw only its own rounds
    momentum = {n: loops[0].optimizer.state[p]["momentum_buffer"] for n, p in loops[0].global_params.items()}
    torch.testing.assert_close(momentum["w"], 0.9 * means[1]["w"] + means[3]["w"], atol=1e-6, rtol=0)
    torch.testing.assert_close(momentum["b"], means[2]["b"], atol=0, rtol=0)
