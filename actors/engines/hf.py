"""The ``hf`` engine: batched sampling with a transformers model and its KV cache.

Sampling is from the model's plain distribution (temperature 1, no top-k/top-p), so the
logprobs reported here are the ones the trainer recomputes; any gap between them is
the inference/trainer mismatch that TIS/MIS corrects, not a sampling transform.
"""

from __future__ import annotations

import torch
from torch import Tensor

from actors.engines import Sample
from actors.model import load_policy


class HFEngine:
    def __init__(self, model_path: str, max_new_tokens: int, seed: int, device: torch.device = torch.device("cpu")):
        self.model, self.tokenizer = load_policy(model_path)
        self.model.to(device).eval()
        self.device = device
        self.tokenizer.padding_side = "left"
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator().manual_seed(seed)

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        # on CPU the model adopts the given tensors (shared-memory views) without a copy; a GPU copies them in
        self.model.load_state_dict(state_dict, assign=self.device.type == "cpu", strict=True)

    @torch.no_grad()
    def generate(self, prompts: list[str], samples_per_prompt: int) -> list[list[Sample]]:
        repeated = [p for p in prompts for _ in range(samples_per_prompt)]
        encoded = self.tokenizer(repeated, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        # transformers samples from the global RNG: seed it from our own stream so runs repeat
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=self.generator)))
        out = self.model.generate(
            **encoded,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=self.max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        prompt_len = encoded.input_ids.shape[1]
        tokens = out.sequences[:, prompt_len:]
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        encoded, tokens, logprobs = encoded.to("cpu"), tokens.cpu(), logprobs.cpu()
        samples = [self._sample(encoded, i, tokens[i], logprobs[i]) for i in range(len(repeated))]
        return [samples[i : i + samples_per_prompt] for i in range(0, len(samples), samples_per_prompt)]

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str]) -> list[Sample]:
        encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        pairs = [(encode(p), encode(c) + [self.tokenizer.eos_token_id]) for p, c in zip(prompts, completions)]
        width = max(len(p) + len(c) for p, c in pairs)
        ids = torch.full((len(pairs), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, (prompt, completion) in enumerate(pairs):
            ids[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            attention[row, : len(prompt) + len(completion)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
        logprobs = logits.float().log_softmax(-1).cpu()
        return [
            Sample(
                p,
                c,
                logprobs[row, len(p) - 1 : len(p) + len(c) - 1]
                .gather(-1, torch.tensor(c)[:, None])
                .squeeze(-1)
                .tolist(),
                text,
            )
            for row, ((p, c), text) in enumerate(zip(pairs, completions))
        ]

    def _sample(self, encoded, row: int, tokens: Tensor, logprobs: Tensor) -> Sample:
        eos = (tokens == self.tokenizer.eos_token_id).nonzero()
        length = int(eos[0]) + 1 if len(eos) else len(tokens)
        completion = tokens[:length].tolist()
        return Sample(
            prompt_ids=encoded.input_ids[row][encoded.attention_mask[row].bool()].tolist(),
            completion_ids=completion,
            logprobs=logprobs[:length].tolist(),
            text=self.tokenizer.decode(completion, skip_special_tokens=True),
        )
