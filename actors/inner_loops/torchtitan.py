"""The ``torchtitan`` inner loop: a TorchTitan model definition, FSDP2, TorchTitan's optimizer.

The model is built from a local HF checkpoint the way TorchTitan's RL trainer builds its
policy: an HF config becomes a TorchTitan model config, the model is built on ``meta``,
parallelized (FSDP2 over the trainer mesh, by TorchTitan's own ``parallelize_*``),
materialized, and loaded with the HF weights through TorchTitan's state-dict adapter.
Weights and gradients leave under HF names (the adapter's ``to_hf``), so the generator
engines, the weight store and the parity tests see the same names as with ``native``.

Architectures: ``LlamaForCausalLM`` (TorchTitan's llama3), ``Qwen3ForCausalLM`` (qwen3),
and ``Qwen2ForCausalLM`` (the qwen3 definition without QK-norm and with q/k/v biases,
which is exactly Qwen2).

Fixes that make it run on CPU and over gloo, and why:

- Device type: ``torchtitan.tools.utils`` fixes its device type at import and falls back
  to ``"cuda"`` when torch reports no accelerator, so every mesh it builds would be a CUDA
  mesh. Where CUDA is absent, torch is made to report ``"cpu"`` for the duration of that
  one import; where CUDA is present (a controller on a GPU host imports this module too)
  nothing is patched.
- Attention: FlexAttention (TorchTitan's default) has no CPU backward, and TorchTitan's
  SDPA backend takes no mask. ``PackedSDPA`` is SDPA over the packed rows' passes
  (``actors/models/attention.py``: a dense mask for short lanes, row by row for long rows),
  each token seeing its own row's prompt and completion, at its row's positions, which
  reproduces HF's logits on each row.
- gloo has no ``PREMUL_SUM``: FSDP2 modules reduce with a plain sum
  (``set_force_sum_reduction_for_comms``). TorchTitan also turns off FSDP2's gradient
  division, so ranks' gradients add up, which is what the shared step's per-rank losses
  (parts of one global sum) need: ``backward`` does not multiply by the world size.

FSDP2 gathers a layer's parameters in every forward (and again in backward), so the loop
runs in ``lockstep``: ranks whose share of the rows is smaller run idle passes, and every
rank joins the same gathers in the same order.

bf16 is TorchTitan's mixed precision: ``TrainingConfig(mixed_precision_param="bfloat16",
mixed_precision_reduce="float32")``, which its ``parallelize_*`` turn into FSDP2's
``MixedPrecisionPolicy``: fp32 sharded parameters and AdamW state, bf16 copies gathered
for each forward and backward, gradients taken in bf16 then reduced and kept in fp32,
bf16 logits. The policy lives in ``fully_shard``, so in bf16 the model is sharded even
over a trainer mesh of one process (as TorchTitan itself does: a shard degree of 1
gathers nothing but casts); that needs ``torch.distributed`` initialized, which the
Trainer does. It works over gloo on CPU. In fp32 a one-process mesh stays a plain module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _import_torchtitan_for_this_host() -> None:
    """Import ``torchtitan.tools.utils`` with torch reporting ``"cpu"`` when there is no CUDA."""
    if torch.cuda.is_available() or "torchtitan.tools.utils" in sys.modules:
        return
    import torch._utils as torch_utils

    report = torch_utils._get_available_device_type
    torch_utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils  # noqa: F401
    finally:
        torch_utils._get_available_device_type = report


_import_torchtitan_for_this_host()

from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Decoder, Embedding, Linear, RMSNorm, RoPE
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.llama3 import Llama3Model, parallelize_llama
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.module import Module
from torchtitan.protocols.state_dict_adapter import StateDictAdapter
from torchtitan.tools.utils import device_type as torchtitan_device_type

from actors.contract.train_batch import TrainBatch
from actors.inner_loops.base import CPU, MicroBatchLoop
from actors.inner_loops.checkpoint import load_checkpoint, save_checkpoint
from actors.inner_loops.config import TrainerConfig
from actors.models.attention import PackedAttention
from actors.models.packing import LanePass, PackedRows, lane_tokens
from losses import Logits


class TorchTitanModelError(ValueError):
    """A model directory this loop cannot train; the message says what and what to do."""


# -- attention --------------------------------------------------------------------------


class PackedSDPA(Module):
    """TorchTitan inner attention: SDPA over a packed pass's rows, each query over what it sees
    (``PackedAttention``, ``actors/models/attention.py``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config):
        super().__init__()

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: PackedAttention,
        scale: float | None = None,
        **_: object,
    ) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        return attention_masks.attend(q, k, v, scale).transpose(1, 2)


# -- HF architectures -> TorchTitan model definitions -----------------------------------------


class Qwen2StateDictAdapter(Qwen3StateDictAdapter):
    """Qwen3's adapter plus Qwen2's q/k/v biases (Qwen3 has none; the names map one to one)."""

    def __init__(self, model_config: Qwen3Model.Config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        for proj in "qkv":
            hf = f"model.layers.{{}}.self_attn.{proj}_proj.bias"
            self.from_hf_map[hf] = f"layers.{{}}.attention.qkv_linear.w{proj}.bias"


@dataclass(frozen=True)
class Family:
    """How one HF architecture maps onto a TorchTitan model definition."""

    model: type[Decoder]
    block: type[nn.Module]
    rope: type[RoPE]
    adapter: type[StateDictAdapter]
    parallelize: Callable[..., nn.Module]
    qk_norm: bool = False
    qkv_bias: bool = False


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(
        Llama3Model, Llama3TransformerBlock, ComplexRoPE, Llama3StateDictAdapter, parallelize_llama
    ),
    "Qwen3ForCausalLM": Family(
        Qwen3Model, Qwen3TransformerBlock, CosSinRoPE, Qwen3StateDictAdapter, parallelize_qwen3, qk_norm=True
    ),
    "Qwen2ForCausalLM": Family(
        Qwen3Model, Qwen3TransformerBlock, CosSinRoPE, Qwen2StateDictAdapter, parallelize_qwen3, qkv_bias=True
    ),
}

LOADED = {"weight": skip_param_init, "bias": skip_param_init}  # every parameter comes from the checkpoint


def read_hf_config(model_path: str) -> tuple[PretrainedConfig, Family]:
    """The HF config of ``model_path`` and its TorchTitan family, or a ``TorchTitanModelError``."""
    from transformers import AutoConfig

    if not (Path(model_path) / "config.json").is_file():
        raise TorchTitanModelError(
            f"the torchtitan inner loop found no HF model at {model_path!r} (no config.json there); point the "
            "topology's model.path at a directory saved with save_pretrained, or use model.init for a tiny model"
        )
    hf = AutoConfig.from_pretrained(model_path)
    arch = (getattr(hf, "architectures", None) or ["(none given)"])[0]
    if arch not in FAMILIES:
        raise TorchTitanModelError(
            f"the torchtitan inner loop cannot train {model_path!r}: its architecture is {arch}, and the "
            f"architectures it maps onto TorchTitan model definitions are {', '.join(FAMILIES)}; use "
            "inner_loop: native (any HF causal LM) for this model"
        )
    unsupported = _unsupported_options(hf)
    if unsupported:
        raise TorchTitanModelError(
            f"the torchtitan inner loop cannot train {model_path!r} ({arch}): {'; '.join(unsupported)}, "
            "which its TorchTitan definition does not reproduce; use inner_loop: native for this model"
        )
    return hf, FAMILIES[arch]


def _unsupported_options(hf: PretrainedConfig) -> list[str]:
    """HF config options whose model the TorchTitan definition would not match."""
    rope_type = hf.rope_parameters.get("rope_type", "default")
    allowed_ropes = ("default", "llama3") if hf.architectures[0] == "LlamaForCausalLM" else ("default",)
    problems = {
        f"hidden_act is {hf.hidden_act!r} (only 'silu')": hf.hidden_act != "silu",
        "attention_bias is set": getattr(hf, "attention_bias", False),  # Qwen2's q/k/v biases are implicit
        "mlp_bias is set": getattr(hf, "mlp_bias", False),
        "it uses sliding-window attention": getattr(hf, "use_sliding_window", False),
        f"its rope_type is {rope_type!r} (only {' or '.join(allowed_ropes)})": rope_type not in allowed_ropes,
    }
    return [problem for problem, present in problems.items() if present]


def model_config(hf: PretrainedConfig, family: Family) -> Decoder.Config:
    """A TorchTitan model config with the HF config's dimensions, attention by ``PackedSDPA``."""
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads

    def norm(size: int = hf.hidden_size) -> RMSNorm.Config:  # one config per module: parallelize annotates each
        return RMSNorm.Config(normalized_shape=size, eps=hf.rms_norm_eps, param_init=LOADED)

    layers = []
    for _ in range(hf.num_hidden_layers):
        attention = make_gqa_config(
            dim=hf.hidden_size,
            n_heads=heads,
            n_kv_heads=hf.num_key_value_heads,
            head_dim=head_dim,
            wqkv_param_init=LOADED,
            wo_param_init=LOADED,
            inner_attention=PackedSDPA.Config(),
            rope=_rope(hf, family, head_dim),
            qk_norm=norm(head_dim) if family.qk_norm else None,
        )
        attention.qkv_linear.wq.bias = attention.qkv_linear.wkv.bias = family.qkv_bias
        ffn = make_ffn_config(
            dim=hf.hidden_size, hidden_dim=hf.intermediate_size, w1_param_init=LOADED, w2w3_param_init=LOADED
        )
        layers.append(
            family.block.Config(attention_norm=norm(), ffn_norm=norm(), attention=attention, feed_forward=ffn)
        )
    return family.model.Config(
        dim=hf.hidden_size,
        vocab_size=hf.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=hf.vocab_size, embedding_dim=hf.hidden_size, param_init=LOADED),
        norm=norm(),
        lm_head=Linear.Config(in_features=hf.hidden_size, out_features=hf.vocab_size, param_init=LOADED),
        layers=layers,
        enable_weight_tying=bool(hf.tie_word_embeddings),
    )


def _rope(hf: PretrainedConfig, family: Family, head_dim: int) -> RoPE.Config:
    """Rotary embeddings as the HF config sets them (llama3 frequency scaling included)."""
    rope = hf.rope_parameters
    scaling = {}
    if rope.get("rope_type") == "llama3":
        scaling = {
            "scaling": "llama",
            "scaling_factor": rope["factor"],
            "low_freq_factor": rope["low_freq_factor"],
            "high_freq_factor": rope["high_freq_factor"],
            "original_max_position_embeddings": rope["original_max_position_embeddings"],
        }
    return family.rope.Config(dim=head_dim, max_seq_len=hf.max_position_embeddings, theta=rope["rope_theta"], **scaling)


def hf_weights(model_path: str) -> dict[str, Tensor]:
    """Every tensor in the directory's safetensors files, as float32 (the loops train in fp32)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise TorchTitanModelError(
            f"the torchtitan inner loop found no *.safetensors weights in {model_path!r}; re-save the model "
            "with save_pretrained (safetensors is its default)"
        )
    return {name: tensor.float() for file in files for name, tensor in load_file(file).items()}


# -- parallelism -------------------------------------------------------------------------------


@dataclass
class _Job:
    """What ``Decoder.Config.update_from_config`` reads from a job config: the parallelism."""

    parallelism: ParallelismConfig


PARALLELISM = ParallelismConfig(spmd_backend="partial_dtensor", data_parallel_shard_degree=-1)
TITAN_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # TrainingConfig's names


def fully_shard_over(model: Decoder, family: Family, world: int, dtype: torch.dtype) -> None:
    """FSDP2 over the whole trainer mesh, by TorchTitan's own ``parallelize_*`` (parameters
    gathered in ``dtype``, gradients reduced in fp32, no compile, no activation
    checkpointing), then the gloo-safe reductions."""
    if torchtitan_device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "torchtitan was imported before actors.inner_loops.torchtitan on a host without CUDA, so it "
            "builds CUDA meshes; import actors.inner_loops.torchtitan first"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "the torchtitan inner loop shards its model with FSDP2 (over several ranks, or for bf16 mixed "
            "precision even on one), which needs torch.distributed initialized; call "
            "torch.distributed.init_process_group first (the Trainer actor does), or train in fp32 on one process"
        )
    family.parallelize(
        model,
        parallel_dims=ParallelDims.from_config(PARALLELISM, world),
        training=TrainingConfig(mixed_precision_param=TITAN_DTYPES[dtype], mixed_precision_reduce="float32"),
        parallelism=PARALLELISM,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def full(tensor: Tensor) -> Tensor:
    """The whole tensor behind a (possibly sharded) parameter or gradient; a collective for DTensors."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


# -- the loop ---------------------------------------------------------------------------------

FULL = StateDictOptions(full_state_dict=True)
NO_DECAY = 2**62  # the LR schedule's length: TorchTitan's schedule is constant until its decay starts


class TorchTitanLoop(MicroBatchLoop):
    """``MicroBatchLoop`` over a TorchTitan model, FSDP2 (world > 1, or bf16), and TorchTitan's AdamW.

    The head is ``Logits`` (the completion positions of the model's own output): the
    forward must run through the FSDP2 root so that the LM head's parameters are gathered,
    so logits exist per micro-batch, the head applied only to the states that predict a
    completion token and those gathered into ``[rows, tokens, vocab]``; size
    ``micro_batch_tokens`` for that.
    """

    lockstep = True

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device = CPU):
        super().__init__(model_path, cfg, rank, world, device)
        hf, family = read_hf_config(model_path)
        self.lane = lane_tokens(hf)  # the packed rows' lanes, sized as the HF model's (actors/models/packing.py)
        config = model_config(hf, family)
        config.update_from_config(config=_Job(PARALLELISM))
        with torch.device("meta"):
            self.model: Decoder = config.build()
        if world > 1 or self.compute_dtype != torch.float32:  # mixed precision is FSDP2's
            fully_shard_over(self.model, family, world, self.compute_dtype)
        self.model.to_empty(device=device)
        self.model.init_states(buffer_device=device)
        self.adapter = family.adapter(config, None)
        self._load_policy(hf_weights(model_path))
        self.model.train()
        self.optimizers = self._optimizers()
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0).build(
            optimizers=self.optimizers, training_steps=NO_DECAY
        )

    def _optimizers(self) -> OptimizersContainer:
        """TorchTitan's AdamW with our hyperparameters (its fused kernel where there is CUDA)."""
        opt = self.cfg.optimizer
        group = ParamGroupConfig(
            pattern=r".*",
            optimizer_name="AdamW",
            optimizer_kwargs={"lr": opt.lr, "betas": tuple(opt.betas), "weight_decay": opt.weight_decay},
        )
        implementation = "fused" if self.device.type == "cuda" else "for-loop"
        return OptimizersContainer.Config(param_groups=[group], implementation=implementation).build(
            model_parts=[self.model]
        )

    # -- the step's hooks ----------------------------------------------------------------------

    def head(self, batch: TrainBatch) -> Logits:
        """The logits that predict each row's completion, from one pass over the rows packed
        (``actors/models/packing.py``): the LM head is applied to the states that predict a completion token only."""
        packed = self.packed(batch)
        return Logits(packed.gather([self._logits_at(lane, kept) for lane, kept in zip(packed.passes, packed.kept)]))

    def pack(self, rows: TrainBatch) -> PackedRows:
        """``rows`` packed with the states that predict a completion token kept (``PackedRows.predicted``)."""
        return rows.packed(self.lane).predicted()

    def _logits_at(self, lane: LanePass, kept: Tensor) -> Tensor:
        """``[1, len(kept), V]``: the model's logits at the ``kept`` places of a pass's flattened states (the forward
        runs through the FSDP2 root, which gathers the LM head's parameters; a hook narrows the head's input)."""

        def narrow(_: nn.Module, args: tuple) -> tuple:
            return (args[0].flatten(0, 1)[kept][None], *args[1:])

        hook = self.model.lm_head.register_forward_pre_hook(narrow)
        try:
            return self.model(lane.input_ids, positions=lane.position_ids, attention_masks=lane.attention)
        finally:
            hook.remove()

    def backward(self, loss: Tensor) -> None:
        """TorchTitan's FSDP2 sums gradients over ranks (no division), and each rank's loss is
        its part of the global sum: no world-size factor."""
        loss.backward()

    def no_sync(self) -> AbstractContextManager:
        return self._no_sync() if self.world > 1 else nullcontext()

    @contextmanager
    def _no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def zero_grad(self) -> None:
        self.optimizers.zero_grad(set_to_none=True)

    def clip_gradients(self) -> float:
        max_norm = self.cfg.optimizer.grad_clip or float("inf")
        return float(clip_grad_norm_(list(self.model.parameters()), max_norm))

    def optimizer_step(self) -> None:
        self.optimizers.step()
        self.schedulers.step()

    # -- weights, gradients, checkpoints (collectives: every rank calls) -----------------------

    def gradients(self) -> dict[str, Tensor]:
        grads = {name: full(p.grad) for name, p in self.model.named_parameters() if p.grad is not None}
        return self.adapter.to_hf(grads)

    def state_dict(self) -> dict[str, Tensor]:
        state = self._hf_state()
        if self.model.enable_weight_tying:  # HF names the tied head too, and the engines load strictly
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def _hf_state(self) -> dict[str, Tensor]:
        """The weights under HF names, a tied head once (as safetensors files hold it)."""
        return self.adapter.to_hf({name: full(tensor) for name, tensor in self.model.state_dict().items()})

    def save(self, directory: Path, state: dict) -> None:
        policy = self._hf_state()
        optimizer = _by_index(get_optimizer_state_dict(self.model, self.optimizers.optimizers, options=FULL))
        if self.rank == 0:
            save_checkpoint(directory, policy, optimizer, state)

    def load(self, directory: Path) -> dict:
        policy, optimizer, state = load_checkpoint(directory)
        self._load_policy(policy)
        names = [name for name, _ in self.model.named_parameters()]
        set_optimizer_state_dict(self.model, self.optimizers.optimizers, _by_name(optimizer, names), options=FULL)
        return state

    def _load_policy(self, hf_state: dict[str, Tensor]) -> None:
        """Full HF-named weights into the (possibly sharded) model; every parameter must be there."""
        set_model_state_dict(self.model, self.adapter.from_hf(hf_state), options=FULL)


def _by_index(optimizer: dict) -> dict:
    """An FQN-keyed optimizer state dict keyed by parameter position instead, as torch's own
    (and ``actors.inner_loops.checkpoint``) key it."""
    names = [name for group in optimizer["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in optimizer["param_groups"]]
    return {"state": {index[name]: slots for name, slots in optimizer["state"].items()}, "param_groups": groups}


def _by_name(optimizer: dict, names: list[str]) -> dict:
    """``_by_index`` undone: positions are the model's parameter order, as the optimizer was built."""
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in optimizer["param_groups"]]
    return {"state": {names[int(i)]: slots for i, slots in optimizer["state"].items()}, "param_groups": groups}
