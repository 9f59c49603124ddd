"""The ``trl`` inner loop: TRL's GRPOTrainer machinery around ``losses.compose_loss``.

TRL prepares the model (dtype, its fused LM head, Accelerate and DDP) and builds the optimizer
and LR schedule from its ``GRPOConfig``; under TRL's own training it computes the policy's token
logprobs with its own ``_get_per_token_logps_and_entropies``, while our loop runs the model through
TRL's wrapper with its LM head off and hands the loss hidden states and the head's weight. The
loss is ours, plugged in by ``ComposerGRPOTrainer``, a ``GRPOTrainer`` subclass overriding ``_compute_loss``. Rollouts
come from our Generator: TRL's generation and dataloader are never used here. Precision
``bf16`` is TRL's own ``bf16=True``: Accelerate's autocast around TRL's forward, over fp32
weights and optimizer state (on CPU too). With ``lora``, TRL's own ``peft_config`` path wraps
the model in PEFT (the base frozen), so its optimizer holds the adapters only.

``ComposerGRPOTrainer`` is also a public API for people who train with TRL directly::

    from actors.inner_loops.trl import ComposerGRPOTrainer
    from losses import LossConfig, policy_config

    trainer = ComposerGRPOTrainer(model="path/to/model", reward_funcs=..., args=GRPOConfig(..., bf16=False),
                                  train_dataset=..., loss=LossConfig(policy=policy_config(name="gspo")))
    trainer.train()

It overrides private methods, so the TRL version is pinned (``TRL_VERSION``) and checked
on import.
"""

from __future__ import annotations

import tempfile
from contextlib import AbstractContextManager, nullcontext

import torch
import trl
from datasets import Dataset
from torch import Tensor

from actors.contract.train_batch import TrainBatch
from actors.inner_loops.base import CPU, HFModelLoop
from actors.inner_loops.config import TrainerConfig
from actors.models.lora import head_weight, peft_config
from actors.models.policy import lm_head_off
from losses import (
    Counts,
    Head,
    LinearHead,
    Logits,
    LossConfig,
    LossInputs,
    LossOutput,
    PolicyInputs,
    TokenLogprobs,
    compose_loss,
)

TRL_VERSION = "1.16.0"  # the pin in pyproject.toml's ``trl`` extra; tests check both agree

if trl.__version__ != TRL_VERSION:
    raise ImportError(
        f"the trl inner loop overrides GRPOTrainer internals (_compute_loss, _get_per_token_logps_and_entropies) "
        f"as they are in TRL {TRL_VERSION}, but TRL {trl.__version__} is installed. Install the pinned version "
        f"with `pip install -e '.[trl]'` (trl=={TRL_VERSION}), or choose another inner_loop."
    )

from trl import GRPOConfig, GRPOTrainer

LOSS_INPUTS = "composer_loss_inputs"  # the inputs key under which our loop passes the step-normalized LossInputs
TAID_T = "composer_taid_t"
PACKED = "composer_packed"  # the inputs key of the micro-batch's rows packed for one pass (``actors/models/packing.py``)


class ComposerGRPOTrainer(GRPOTrainer):
    """A ``GRPOTrainer`` whose loss is ``compose_loss(loss)``; everything else is TRL's.

    Under ``train()`` the policy channel reads TRL's batch (advantages, ``old_per_token_logps``,
    ``ref_per_token_logps``) and normalizes like TRL does for this process and accumulation
    window, so a policy loss that TRL also has gives TRL's loss. Our inner loop instead
    passes ready ``LossInputs`` (all three channels, normalized by the whole step).
    """

    def __init__(self, *args, loss: LossConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_config = loss

    def _compute_loss(self, model, inputs: dict) -> Tensor:
        loss_inputs = inputs.get(LOSS_INPUTS)
        loss = self.loss_config
        distills = loss_inputs is not None and loss_inputs.distill is not None and loss.alpha_sdpo > 0
        distribution = (distills and loss.distill.signal == "divergence") or loss.policy.entropy_coef > 0
        head = self.policy_head(model, inputs, distribution)
        if loss_inputs is not None:  # our inner loop: it reduces and reports the metrics
            out = compose_loss(head, loss_inputs, self.loss_config, taid_t=inputs.get(TAID_T))
            self.last_metrics = out.metrics
            return out.loss
        out = compose_loss(head, self._trl_loss_inputs(inputs, head), self.loss_config)
        mode = "train" if self.model.training else "eval"
        for name, value in out.metrics.items():  # TRL averages and logs these with its own
            self._metrics[mode][name].append(value)
        return out.loss

    def policy_head(self, model, inputs: dict, distribution: bool) -> Head:
        """Under our inner loop, the last hidden states that predict each row's completion from one pass over the
        rows packed (``actors/models/packing.py``) and the LM head's weight: logits are formed chunk by chunk in the
        loss, never whole, as the native loop does. Under TRL's own training, TRL's token logprobs (its fused LM head
        never builds ``[B, T, V]``), or the full logits when a loss channel needs the whole distribution
        (distillation, the entropy bonus)."""
        if (packed := inputs.get(PACKED)) is not None:
            with self.accelerator.autocast(), lm_head_off(self.model):  # as TRL wraps its forward (a no-op unless bf16)
                hidden = packed.run(model, self.model.config)
            dtype = torch.bfloat16 if self.args.bf16 else hidden.dtype  # the head's inputs as autocast casts them
            return LinearHead(hidden.to(dtype) / self.temperature, head_weight(self.model).to(dtype))
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        if distribution:
            with self.accelerator.autocast():  # as TRL wraps its own forward (a no-op unless bf16)
                logits = model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=inputs.get("position_ids")
                )
            return Logits(logits.logits[:, prompt_ids.shape[1] - 1 : -1] / self.temperature)
        logprobs, entropy, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.shape[1], compute_entropy=True
        )
        return TokenLogprobs(logprobs, entropy)

    def _trl_loss_inputs(self, inputs: dict, head: Head) -> LossInputs:
        """The policy channel from TRL's own batch, with TRL's per-process normalizers."""
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        accumulation = self.current_gradient_accumulation_steps if self.model.training else 1
        tokens = float(inputs["num_items_in_batch"]) / self.accelerator.num_processes
        if self.model.training:
            tokens *= accumulation / self.args.steps_per_generation
        counts = Counts(
            tokens=max(tokens, 1.0), sequences=mask.shape[0] * accumulation, max_len=self.max_completion_length
        )
        old = inputs.get("old_per_token_logps")
        if old is None:  # TRL skips it when the batch is on-policy: ratio 1
            old = head.logprobs.detach()
        policy = PolicyInputs(
            mask=mask,
            advantages=inputs["advantages"],
            counts=counts,
            old_logprobs=old,
            ref_logprobs=inputs.get("ref_per_token_logps"),
        )
        return LossInputs(targets=inputs["completion_ids"], policy=policy)


class TRLLoop(HFModelLoop):
    """Our step (micro-batches, channel 3 by gradient caching) through a ``ComposerGRPOTrainer``."""

    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device = CPU):
        super().__init__(model_path, cfg, rank, world, device)
        opt = cfg.optimizer
        self._output_dir = tempfile.TemporaryDirectory(prefix="trl-")
        args = GRPOConfig(
            output_dir=self._output_dir.name,
            report_to="none",
            save_strategy="no",
            use_cpu=device.type == "cpu",
            bf16=self.compute_dtype == torch.bfloat16,  # Accelerate's autocast; fp32 weights and optimizer
            model_init_kwargs={"dtype": torch.float32},
            learning_rate=opt.lr,
            adam_beta1=opt.betas[0],
            adam_beta2=opt.betas[1],
            weight_decay=opt.weight_decay,
            max_grad_norm=opt.grad_clip,
            lr_scheduler_type="constant",
            temperature=1.0,  # the logprobs of the policy itself, as the other loops score them
            beta=0.0,
            use_bias_correction_kl=False,  # TRL's default is True; the KL, if any, is configured in loss.policy
            ddp_broadcast_buffers=False,  # rotary tables are constants; ranks may run different numbers of forwards
            # every trained parameter takes a gradient in each backward; the LM head's through the loss's LinearHead,
            # outside the wrapped forward, which DDP would otherwise mark unused (ready) before its gradient comes
            ddp_find_unused_parameters=False,
            per_device_train_batch_size=2,  # TRL's generation batch must hold a group; it is never used
            num_generations=2,
            # TRL's default is True: only Trainer.train(), never run here, would turn it on, but with a PEFT model
            # TRL makes the embeddings' outputs require grads for it, a backward pass through them for nothing
            gradient_checkpointing=False,
            # TRL seeds every RNG with ``seed`` before it builds the adapters: the trainer's own seed, so a LoRA run's
            # adapters start as the native loop's would (numpy takes seeds below 2**32)
            seed=torch.initial_seed() % 2**32,
        )
        self.trainer = ComposerGRPOTrainer(
            model=model_path,
            reward_funcs=_no_reward,  # rewards come from our Rewarder
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [""]}),  # required by TRL; its dataloader is never iterated
            loss=cfg.loss,
            peft_config=None if cfg.lora is None else peft_config(cfg.lora),  # TRL wraps and freezes the base
        )
        self.model = self.trainer.model
        self.model.train()
        self.wrapped = self.trainer.accelerator.prepare_model(self.model) if world > 1 else self.model
        self.trainer.create_optimizer_and_scheduler(num_training_steps=1)  # constant LR: the length does not matter
        self.optimizer = self.trainer.optimizer
        self.trainer.current_gradient_accumulation_steps = 1  # set by TRL's own training loop otherwise

    def micro_loss(self, batch: TrainBatch, inputs: LossInputs, taid_t: float | None) -> LossOutput:
        loss = self.trainer.compute_loss(self.wrapped, self._trl_inputs(batch) | {LOSS_INPUTS: inputs, TAID_T: taid_t})
        return LossOutput(loss, self.trainer.last_metrics)

    def head(self, batch: TrainBatch) -> Head:
        return self.trainer.policy_head(self.wrapped, self._trl_inputs(batch), distribution=False)

    def _trl_inputs(self, batch: TrainBatch) -> dict:
        completion = slice(batch.prompt_len, None)
        return {
            "completion_ids": batch.input_ids[:, completion],
            "completion_mask": batch.attention_mask[:, completion],
            PACKED: self.packed(batch),
        }

    def backward(self, loss: Tensor) -> None:
        self.trainer.accelerator.backward(loss * self.world)  # DDP averages over ranks

    def no_sync(self) -> AbstractContextManager:
        return self.trainer.accelerator.no_sync(self.wrapped) if self.world > 1 else nullcontext()

    def clip_gradients(self) -> float:
        max_norm = self.cfg.optimizer.grad_clip or float("inf")
        return float(self.trainer.accelerator.clip_grad_norm_(self.model.parameters(), max_norm))

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.trainer.lr_scheduler.step()


def _no_reward(completions: list, **kwargs) -> list[float]:
    raise RuntimeError("the trl inner loop trains on our Generator's rollouts; TRL's reward path never runs")
