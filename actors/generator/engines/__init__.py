"""Generator engines: sample completions and their per-token logprobs from a policy.

An engine implements ``Engine``; the Generator actor owns weight versions, the engine
only samples with whatever weights it was last given. ``generate``, ``continue_from``, ``logprobs_of`` and
``score`` are coroutines so that one engine can serve concurrent requests: ``vllm`` batches them
continuously, ``hf`` takes them one at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from actors.basics.seeds import seed_of
from actors.contract.rollouts import Trajectory
from actors.generator.config import Sampling  # noqa: F401  the engines' input, re-exported beside their output

if TYPE_CHECKING:
    from threading import Event

    from torch import Tensor


def sampling_seeds(seed: int, stream: str, count: int) -> list[int]:
    """One seed per prompt of a stream (e.g. ``"step 12"``, ``"eval 50"``): the sampling
    randomness of prompt i is a function of (seed, stream, i) and of nothing that happened
    before, so a resumed run, or a request retried on a respawned generator, samples
    exactly what the uninterrupted run sampled."""
    return [seed_of(f"{seed}/{stream}/{i}") for i in range(count)]


def request_seed(seeds: list[int]) -> int:
    """One seed for a whole request (an engine that samples a request as one batch)."""
    return seed_of("/".join(map(str, seeds)))


def piece_seed(seed: int, piece: int) -> int:
    """The seed of a turn's ``piece``-th part: 0 is the turn's own seed; a turn that a weight update interrupted
    goes on with fresh randomness, not with its first tokens' draws over again."""
    return seed if piece == 0 else seed_of(f"{seed}/piece {piece}")


class Engine(Protocol):
    """Built as ``Engine(model_path, sampling, compute, adapter)`` inside a generator process; with an
    ``adapter`` (the trainer's ``LoRAConfig``) every state dict it loads is the adapters' tensors
    under PEFT's saved names, to be applied to the base it loaded from ``model_path``. An engine that holds
    what must be released before the actors beside it stop (``vllm``: its process groups) has a ``close()``,
    which the generator calls as it stops."""

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Adopt new weights; the caller guarantees no request is in flight."""

    async def generate(
        self, prompts: list[str], samples_per_prompt: int, seeds: list[int], greedy: bool = False
    ) -> list[list[Trajectory]]:
        """``samples_per_prompt`` completions of each prompt, grouped by prompt; the same
        prompts with the same ``seeds`` (one per prompt) give the same completions. ``greedy``:
        each prompt's argmax continuation instead (the evaluation's, one per prompt), whatever the
        seeds and the sampling settings."""

    async def continue_from(
        self,
        ids: list[int],
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        interrupt: Event | None = None,
        stop: tuple[str, ...] = (),
        top_logprobs: int = 0,
    ) -> Trajectory:
        """One completion of a token sequence (an episode so far), with ``ids`` as its prompt;
        the same ids and ``seed`` give the same completion (``greedy``: the argmax one). ``max_new_tokens``: at
        most that many tokens (the sampling settings' when None). Once ``interrupt`` is set, the completion ends
        at the next token boundary with the tokens sampled so far (possibly none): a weight update waits for
        it. ``stop``: the completion ends with the token whose text completes one of these strings (its text keeps
        them: the caller cuts it). ``top_logprobs``: each token's most likely alternatives, in
        ``Trajectory.top_logprobs``, under the distribution sampled from."""

    async def logprobs_of(self, prompts: list[str], completions: list[str]) -> list[Trajectory]:
        """Each given completion (EOS appended) as a ``Trajectory``, its logprobs under the loaded weights."""

    async def score(self, ids: list[int], completion_ids: list[int]) -> Trajectory:
        """A reply the policy did not sample (a demonstration's turn), continuing ``ids``, with its logprobs
        under the loaded weights: what ``continue_from`` would report had it sampled these tokens."""
