"""The ``native`` inner loop: an HF model, AdamW, DDP over the trainer mesh, micro-batches.

The loss sees the last hidden states and the LM-head weight (``LinearHead``), so
``[rows, tokens, vocab]`` logits never exist.

bf16 is automatic mixed precision, as TRL and Accelerate do it with ``bf16=True``: fp32
weights and AdamW state, the decoder's forward under ``torch.autocast`` (on CPU too).
Not bf16 weights with fp32 master copies: autocast keeps the one fp32 parameter set
that DDP, the optimizer, checkpoints and the weight publisher already use, with no
second copy to keep in step. The LM head's inputs are cast to bf16 as autocast casts an
``nn.Linear``'s, so the loss kernel's head matmul runs in bf16 and its softmax in fp32.

With LoRA the model is PEFT's: the base frozen, DDP and AdamW over the adapters only, and an
adapter on the LM head folded into the weight the loss kernel reads (``adapters.head_weight``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from actors.contract.train_batch import TrainBatch
from actors.inner_loops.base import CPU, HFModelLoop
from actors.inner_loops.config import TrainerConfig
from actors.models.lora import head_weight, with_adapter
from actors.models.packing import PackedRows
from actors.models.policy import load_policy
from losses import LinearHead


class HiddenStates(nn.Module):
    """The decoder without its LM head; DDP wraps this so gradients sync in backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, packed: PackedRows) -> Tensor:
        """The states that predict each row's completion, from one pass over the ``packed`` rows
        (``actors/models/packing.py``): ``[rows, T, hidden]``."""
        return packed.run(self.model.get_decoder())


class NativeLoop(HFModelLoop):
    def __init__(self, model_path: str, cfg: TrainerConfig, rank: int, world: int, device: torch.device = CPU):
        super().__init__(model_path, cfg, rank, world, device)
        self.model, _ = load_policy(model_path)
        if cfg.lora is not None:  # the base frozen, fresh adapters trained (seeded by the trainer)
            self.model = with_adapter(self.model, cfg.lora)
        self.model.to(device).train()
        self.hidden = HiddenStates(self.model)
        if world > 1:  # buffers are constants (rotary tables): ranks may run different numbers of forwards
            device_ids = [device] if device.type == "cuda" else None
            self.hidden = DistributedDataParallel(self.hidden, device_ids=device_ids, forward_sync_buffers=False)
        opt = cfg.optimizer
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)

    def head(self, batch: TrainBatch) -> LinearHead:
        with self.autocast():
            hidden = self.hidden(self.packed(batch))
        weight = head_weight(self.model)
        return LinearHead(hidden.to(self.compute_dtype), weight.to(self.compute_dtype))

    def no_sync(self) -> AbstractContextManager:
        return self.hidden.no_sync() if self.world > 1 else nullcontext()

    def clip_gradients(self) -> float:
        max_norm = self.cfg.optimizer.grad_clip or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def optimizer_step(self) -> None:
        self.optimizer.step()
