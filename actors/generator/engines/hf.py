"""The ``hf`` engine: batched sampling with a transformers model and its KV cache.

The logprobs reported are those of the distribution sampled from (after temperature,
top-k, top-p); with the defaults that is the model's plain distribution, the one the
trainer recomputes. A greedy request (the evaluation's) takes each step's argmax, and reports
the model's plain logprobs. Requests run one at a time, each as one padded batch, on a worker
thread, so the generator's event loop stays free while it samples.

With an adapter (the trainer trains LoRA), the base is loaded once and wrapped by PEFT, frozen
and never merged: each weight version is only the adapters' tensors, copied into the adapters,
so a sync moves and touches the adapters alone.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import torch
from torch import Tensor
from transformers import BatchEncoding, StoppingCriteria, StoppingCriteriaList

from actors.basics.compute import Compute
from actors.contract.rollouts import Trajectory
from actors.contract.train_batch import pad_sequences
from actors.generator.config import policy_dtype
from actors.generator.engines import Sampling, request_seed
from actors.models.lora import head_weight
from actors.models.lora_config import LoRAConfig
from actors.models.packing import packed_states
from actors.models.policy import load_policy
from losses import token_logprobs


class HFEngine:
    def __init__(
        self, model_path: str, sampling: Sampling, compute: Compute = Compute(), adapter: LoRAConfig | None = None
    ):
        self.device = compute.device()
        dtype = getattr(torch, policy_dtype("hf", on_gpu=bool(compute.gpus)))  # the dtype weights are published in
        self.model, self.tokenizer = load_policy(model_path, dtype)
        self.adapter = adapter
        if adapter is not None:
            from actors.models.lora import with_adapter

            self.model = with_adapter(self.model, adapter)  # B is zero: the base's policy until a version loads
        self.model.to(self.device).eval()
        self.tokenizer.padding_side = "left"
        self.sampling = sampling
        self._one_at_a_time = asyncio.Lock()

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        if self.adapter is not None:  # the adapters' tensors (PEFT's saved names), copied in; the base stays as is
            from actors.models.lora import load_adapter_state

            load_adapter_state(self.model, state_dict)
            return
        # on CPU the model adopts the given tensors (shared-memory views) without a copy; a GPU copies them in
        self.model.load_state_dict(state_dict, assign=self.device.type == "cpu", strict=True)

    async def generate(
        self, prompts: list[str], samples_per_prompt: int, seeds: list[int], greedy: bool = False
    ) -> list[list[Trajectory]]:
        async with self._one_at_a_time:
            return await asyncio.to_thread(self.generate_now, prompts, samples_per_prompt, seeds, greedy)

    async def continue_from(
        self,
        ids: list[int],
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        interrupt: threading.Event | None = None,
        stop: tuple[str, ...] = (),
        top_logprobs: int = 0,
    ) -> Trajectory:
        async with self._one_at_a_time:
            return await asyncio.to_thread(
                self.continue_from_now, ids, seed, greedy, max_new_tokens, interrupt, stop, top_logprobs
            )

    async def logprobs_of(self, prompts: list[str], completions: list[str]) -> list[Trajectory]:
        async with self._one_at_a_time:
            return await asyncio.to_thread(self.logprobs_of_now, prompts, completions)

    async def score(self, ids: list[int], completion_ids: list[int]) -> Trajectory:
        async with self._one_at_a_time:
            return (await asyncio.to_thread(self.scored_now, [(ids, completion_ids)]))[0]

    def generate_now(
        self, prompts: list[str], samples_per_prompt: int, seeds: list[int], greedy: bool = False
    ) -> list[list[Trajectory]]:
        repeated = [p for p in prompts for _ in range(samples_per_prompt)]
        encoded = self.tokenizer(repeated, return_tensors="pt", padding=True, add_special_tokens=False)
        samples = self._sampled(encoded, request_seed(seeds), greedy)
        return [samples[i : i + samples_per_prompt] for i in range(0, len(samples), samples_per_prompt)]

    def continue_from_now(
        self,
        ids: list[int],
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        interrupt: threading.Event | None = None,
        stop: tuple[str, ...] = (),
        top_logprobs: int = 0,
    ) -> Trajectory:
        if interrupt is not None and interrupt.is_set():  # generate samples one token before it asks
            return Trajectory.single_turn(ids, [], [], "")
        encoded = BatchEncoding(
            {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        )
        return self._sampled(encoded, seed, greedy, max_new_tokens, interrupt, stop, top_logprobs)[0]

    def _decoding(self, greedy: bool) -> dict:
        """``generate``'s arguments for how each token is chosen: the argmax, or a draw under the sampling
        settings."""
        if greedy:
            return {"do_sample": False}
        s = self.sampling
        return {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}

    @torch.no_grad()
    def _sampled(
        self,
        encoded: BatchEncoding,
        seed: int,
        greedy: bool,
        max_new_tokens: int | None = None,
        interrupt: threading.Event | None = None,
        stop: tuple[str, ...] = (),
        top_logprobs: int = 0,
    ) -> list[Trajectory]:
        """One completion per row of ``encoded`` (left-padded prompts); ``interrupt`` ends every row at the token
        boundary after it is set, a ``stop`` string the row that completes it (transformers' stop strings)."""
        encoded = encoded.to(self.device)
        # transformers samples from the global RNG, one request at a time: seed it per request
        torch.manual_seed(seed)
        out = self.model.generate(
            **encoded,
            **self._decoding(greedy),
            **({"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}),
            max_new_tokens=max_new_tokens or self.sampling.max_new_tokens,
            stopping_criteria=StoppingCriteriaList([Interrupted(interrupt)] if interrupt is not None else []),
            output_scores=True,  # after temperature/top-k/top-p: the distribution the tokens came from
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        prompt_len = encoded.input_ids.shape[1]
        tokens = out.sequences[:, prompt_len:]
        distribution = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        logprobs = distribution.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        encoded, tokens, logprobs = encoded.to("cpu"), tokens.cpu(), logprobs.cpu()
        samples = [self._sample(encoded, i, tokens[i], logprobs[i]) for i in range(len(tokens))]
        if top_logprobs:
            top = distribution.topk(top_logprobs, dim=-1)
            samples = [replace(s, top_logprobs=_alternatives(top, i, len(s.completion_ids)))
                       for i, s in enumerate(samples)]
        return samples

    def logprobs_of_now(self, prompts: list[str], completions: list[str]) -> list[Trajectory]:
        """The model's own logprobs of given completions (not truncated by top-k/top-p:
        a teacher's trace may hold tokens the sampler would never draw)."""
        encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        pairs = [(encode(p), encode(c) + [self.tokenizer.eos_token_id]) for p, c in zip(prompts, completions)]
        return [replace(t, text=text) for t, text in zip(self.scored_now(pairs), completions)]

    @torch.no_grad()
    def scored_now(self, pairs: list[tuple[list[int], list[int]]]) -> list[Trajectory]:
        """Each (prompt ids, completion ids) with the completion's logprobs, from one pass over the rows packed
        (``actors/models/packing.py``)."""
        sequences = pad_sequences(*zip(*pairs), self.tokenizer.pad_token_id)  # packed on the host, states on the device
        states = packed_states(self.model, sequences)
        targets = sequences.targets.to(states.device)
        lengths = [len(completion) for _, completion in pairs]  # logits at each row's own tokens only
        logprobs = token_logprobs(states, head_weight(self.model), targets, lengths=lengths).cpu()
        text = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return [Trajectory.single_turn(p, c, logprobs[row, : len(c)].tolist(), text(c)) for row, (p, c) in enumerate(pairs)]

    def _sample(self, encoded, row: int, tokens: Tensor, logprobs: Tensor) -> Trajectory:
        eos = (tokens == self.tokenizer.eos_token_id).nonzero()
        length = int(eos[0]) + 1 if len(eos) else len(tokens)
        completion = tokens[:length].tolist()
        return Trajectory.single_turn(
            prompt_ids=encoded.input_ids[row][encoded.attention_mask[row].bool()].tolist(),
            completion_ids=completion,
            logprobs=logprobs[:length].tolist(),
            text=self.tokenizer.decode(completion, skip_special_tokens=True),
        )


def _alternatives(top, row: int, length: int) -> list[list[tuple[int, float]]]:
    """Row ``row``'s first ``length`` places of ``top`` (a ``topk`` of logprobs) as (token, logprob) lists."""
    ids, values = top.indices[row, :length].tolist(), top.values[row, :length].tolist()
    return [list(zip(place_ids, place_values)) for place_ids, place_values in zip(ids, values)]


class Interrupted(StoppingCriteria):
    """Ends a ``generate`` call at the token boundary after ``event`` is set (from another thread)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs) -> Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)
