"""Parity of ``losses/`` with TRL 1.16 on random float64 inputs: same loss, same gradients.

TRL is imported here only (never by ``losses/``). Every TRL side is TRL's own code on a real
object: ``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``, ``CPOTrainer.cpo_loss`` /
``get_batch_loss_metrics`` run on real trainers built around one tiny random Qwen2 model and a
character tokenizer saved to a temporary directory (no hub access), GKD's
``generalized_jsd_loss`` staticmethod and SDPO's sampled-token loss.

Two levels of comparison where a model is involved:

- end to end: TRL's loss and parameter gradients vs. ours computed from our own float64
  forward of the same model (``logits[:, P-1:-1] / temperature`` -> ``selective_logprobs`` ->
  our loss). TRL 1.16 scores tokens with its fused LM head (``trl.kernels.ChunkedLogProbFunction``),
  which folds the logits in float32 whatever the model dtype, so this level carries ~3e-7 of
  float32 noise: it is checked at ``atol=1e-6``.
- loss math: a forward hook swaps the fused head's ``log_probs`` output for a float64 leaf
  holding the same values; TRL's unmodified loss code and ours then read that one tensor, and
  loss and gradient w.r.t. it must agree to ``1e-12``.

The config's ``bf16`` defaults to ``True`` in TRL's GRPO/DPO/CPO configs (CPU autocast to
bfloat16, ~1e-3 error), so every config here sets ``bf16=False``, except the one test of
TRL's bf16 itself (the trl inner loop's ``precision: bf16``), held to a bf16 bound.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from losses import (
    Counts,
    DistillConfig,
    DistillInputs,
    LossConfig,
    PolicyInputs,
    PreferenceConfig,
    PreferenceInputs,
    TeacherLogits,
    distill_loss,
    policy_config,
    policy_loss,
    preference_loss,
    selective_logprobs,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.gkd import GKDTrainer  # noqa: E402
from trl.experimental.sdpo.loss_utils import compute_sampled_token_self_distillation_loss  # noqa: E402

from actors.inner_loops.trl import ComposerGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

E2E = dict(atol=1e-6, rtol=0.0)  # through TRL's float32 fused LM head
# TRL's bf16 forward against the float64 one, on the GRPO batch below at temperature 0.7 (measured: the
# loss 1.7e-3 off, of 0.13; the gradients 1.2% off in L2)
BF16_LOSS, BF16_GRADIENT = 5e-3, 0.03
EXACT = dict(atol=1e-12, rtol=0.0)  # same float64 inputs on both sides


# ----------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A character tokenizer and a random 2-layer Qwen2, saved where the trainers load them by path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in "abcdefghijklmnopqrstuvwxyz0123456789 ":
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,  # livelier distributions than the default 0.02
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def _common_args(tmp_path_factory, name: str) -> dict:
    return dict(output_dir=str(tmp_path_factory.mktemp(name)), report_to="none", use_cpu=True, bf16=False)


def _float64_train(trainer):
    model = trainer.model.to(torch.float64)
    model.train()  # TRL's normalizers read ``self.model.training``
    return model


class _Float64LogProbs:
    """Forward hook: replace the fused LM head's ``log_probs`` by a float64 leaf of the same values."""

    def __init__(self, model):
        self.leaf: torch.Tensor | None = None
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        assert self.leaf is None, "the policy model was called more than once"
        self.leaf = output.log_probs.detach().to(torch.float64).requires_grad_()
        output.log_probs = self.leaf
        return output

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _grads(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, params))


def _assert_grads_close(ours, theirs, names, **tol):
    for name, a, b in zip(names, ours, theirs, strict=True):
        assert_close(a, b, **tol, msg=lambda m, name=name: f"gradient of {name}: {m}")


# ----------------------------------------------------------------------------- 1. GRPO family


@dataclass
class GRPOBatch:
    ids: torch.Tensor  # prompt ⊕ completion
    attention: torch.Tensor
    inputs: dict  # everything but old/ref logps and num_items_in_batch
    mask: torch.Tensor  # completion mask, bool
    old: dict[str, torch.Tensor]  # by importance-sampling level
    ref: torch.Tensor


B, P, T = 7, 4, 7
PROMPT_LENS = [4, 2, 3, 4, 1, 3, 2]  # left-padded
COMPLETION_LENS = [7, 5, 3, 6, 1, 4, 0]  # right-padded; the last row is empty (e.g. all tool output)
ADVANTAGES = [0.9, -0.6, 1.3, -1.1, 0.4, -0.3, 0.8]
# GSPO rows' target sequence log-ratios, against clip range [0.9, 1.15] (log: -0.105, 0.140):
# row 0 inside, 1 clipped low (A < 0), 2 clipped high (A > 0), 3 inside, 4 below with A > 0 and
# 5 above with A < 0 (both unclipped branches of the min); row 6 has no tokens.
SEQUENCE_LOG_RATIOS = [0.03, -0.35, 0.4, -0.04, -0.5, 0.3, 0.0]


def _grpo_args(tmp_path_factory, name: str, **changes) -> GRPOConfig:
    """The parity tests' GRPO job: 2 prompts x 2 completions of up to 8 tokens."""
    args = _common_args(tmp_path_factory, name) | {
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 8,
        "temperature": 0.7,  # the fused head divides logits by it; so do we
    }
    return GRPOConfig(**(args | changes))


def _grpo_inputs(model_dir, args: GRPOConfig) -> dict:
    """A GRPO trainer's arguments besides its loss: the model, a zero reward and four prompts."""
    return {
        "model": model_dir,
        "reward_funcs": lambda completions, **kwargs: [0.0] * len(completions),
        "args": args,
        "train_dataset": datasets.Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]}),
    }


@pytest.fixture(scope="module")
def grpo(model_dir, tmp_path_factory):
    trainer = GRPOTrainer(**_grpo_inputs(model_dir, _grpo_args(tmp_path_factory, "grpo")))
    model = _float64_train(trainer)

    g = torch.Generator().manual_seed(1234)
    V = model.config.vocab_size
    prompt_ids = torch.randint(3, V, (B, P), generator=g)
    prompt_mask = (torch.arange(P)[None] >= P - torch.tensor(PROMPT_LENS)[:, None]).long()
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, V, (B, T), generator=g)
    completion_mask = (torch.arange(T)[None] < torch.tensor(COMPLETION_LENS)[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    mask = completion_mask.bool()

    with torch.no_grad():
        current = selective_logprobs(_grpo_logits(model, ids, attention, trainer.temperature), completion_ids)
    # Token log-ratios current - old: magnitudes in [0.01, 0.15] or [0.3, 0.6], random signs. Every clip
    # boundary used below (log 0.8, log 1.25, log 1.28) is >= 0.05 away, far beyond the fused head's noise.
    small = torch.empty(B, T, dtype=torch.float64).uniform_(0.01, 0.15, generator=g)
    large = torch.empty(B, T, dtype=torch.float64).uniform_(0.3, 0.6, generator=g)
    magnitude = torch.where(torch.rand(B, T, generator=g) < 0.5, small, large)
    token_delta = torch.where(torch.rand(B, T, generator=g) < 0.5, magnitude, -magnitude)
    # Sequence log-ratios (masked means) exactly SEQUENCE_LOG_RATIOS, with token-level spread around them.
    noise = torch.empty(B, T, dtype=torch.float64).uniform_(-0.3, 0.3, generator=g) * mask
    noise = (noise - noise.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)) * mask
    sequence_delta = torch.tensor(SEQUENCE_LOG_RATIOS, dtype=torch.float64)[:, None] + noise
    ref = current + torch.empty(B, T, dtype=torch.float64).uniform_(-0.4, 0.4, generator=g)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
    }
    batch = GRPOBatch(
        ids, attention, inputs, mask, {"token": current - token_delta, "sequence": current - sequence_delta}, ref
    )
    return trainer, model, batch


def _grpo_logits(model, ids, attention, temperature):
    """Our own forward: full float64 logits at the completion positions, tempered like TRL."""
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    return logits[:, P - 1 : -1] / temperature


# id -> (TRL attributes, importance_sampling_level, our policy_config kwargs)
GRPO_CASES = {
    "grpo": (
        dict(loss_type="grpo", epsilon_low=0.2, epsilon_high=0.28),
        "token",
        dict(name="grpo", clip_low=0.2, clip_high=0.28),
    ),
    "dapo": (
        dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28),
        "token",
        dict(name="dapo", clip_low=0.2, clip_high=0.28),
    ),
    "dr_grpo": (
        dict(loss_type="dr_grpo", epsilon_low=0.2, epsilon_high=0.28),
        "token",
        dict(name="dr_grpo", clip_low=0.2, clip_high=0.28),
    ),
    # TRL's CISPO clamps the ratio at epsilon_high itself: an absolute cap.
    "cispo": (
        dict(loss_type="cispo", epsilon_low=0.2, epsilon_high=1.25),
        "token",
        dict(name="cispo", cispo_max_ratio=1.25),
    ),
    # GSPO = sequence-level importance sampling; the loss_type picks the aggregation.
    "gspo": (
        dict(loss_type="grpo", epsilon_low=0.1, epsilon_high=0.15),
        "sequence",
        dict(name="gspo", clip_low=0.1, clip_high=0.15),
    ),
    "gspo_dapo": (
        dict(loss_type="dapo", epsilon_low=0.1, epsilon_high=0.15),
        "sequence",
        dict(name="gspo", clip_low=0.1, clip_high=0.15, aggregation="token_mean"),
    ),
    "gspo_dr_grpo": (
        dict(loss_type="dr_grpo", epsilon_low=0.1, epsilon_high=0.15),
        "sequence",
        dict(name="gspo", clip_low=0.1, clip_high=0.15, aggregation="constant"),
    ),
    # TRL's delta (INTELLECT-2) is our dual_clip for delta > 1 + epsilon_high: log delta = 0.27 lies between
    # log 1.28 and the large token log-ratios (>= 0.3), so the cap binds on every large ratio with A < 0.
    "grpo_delta": (
        {"loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.28, "args.delta": math.exp(0.27)},
        "token",
        dict(name="grpo", clip_low=0.2, clip_high=0.28, dual_clip=math.exp(0.27)),
    ),
    "sapo": (
        {"loss_type": "sapo", "args.sapo_temperature_pos": 0.8, "args.sapo_temperature_neg": 1.3},
        "token",
        dict(name="sapo", sapo_tau_pos=0.8, sapo_tau_neg=1.3),
    ),
}
KL_CASES = {"no_kl": (0.0, False), "k3": (0.04, False), "k3_unbiased": (0.04, True)}
OTHER_MICROBATCH_TOKENS = 9  # accumulation: the step's other micro-batch, seen only through the counts


@pytest.mark.parametrize("accumulation", [1, 2], ids=["accum1", "accum2"])
@pytest.mark.parametrize("kl", list(KL_CASES))
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_family_matches_trl_compute_loss(grpo, case, kl, accumulation):
    trainer, model, batch = grpo
    trl_attrs, level, ours = GRPO_CASES[case]
    beta, unbiased = KL_CASES[kl]

    # The knobs _compute_loss reads, set on the one real trainer (``args.`` ones on its config).
    trainer.args.delta = None
    for name, value in trl_attrs.items():
        owner, _, attribute = name.rpartition(".")
        setattr(trainer.args if owner == "args" else trainer, attribute, value)
    trainer.importance_sampling_level = level
    trainer.beta = beta
    trainer.args.use_bias_correction_kl = unbiased
    trainer.top_entropy_quantile = 1.0
    trainer.off_policy_mask_threshold = None
    trainer._entropy_bonus_enabled = False
    trainer.use_vllm = False
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.args.steps_per_generation = accumulation
    assert trainer.accelerator.num_processes == 1 and trainer.model.training and not trainer.aux_loss_enabled

    mask = batch.mask
    step_tokens = int(mask.sum()) + (OTHER_MICROBATCH_TOKENS if accumulation > 1 else 0)
    inputs = dict(batch.inputs, old_per_token_logps=batch.old[level], num_items_in_batch=torch.tensor(step_tokens))
    if beta:
        inputs["ref_per_token_logps"] = batch.ref
    if accumulation == 1:
        counts = Counts.from_mask(mask, max_len=trainer.max_completion_length)
    else:
        counts = Counts(tokens=step_tokens, sequences=B * accumulation, max_len=trainer.max_completion_length)
    assert counts.max_len == 8 and counts.tokens == step_tokens

    def ours_loss(logprobs):
        policy_inputs = PolicyInputs(
            mask=mask,
            advantages=batch.inputs["advantages"],
            counts=counts,
            old_logprobs=batch.old[level],
            ref_logprobs=batch.ref if beta else None,
        )
        cfg = policy_config(kl_coef=beta, kl_unbiased=unbiased, **ours)
        return policy_loss(logprobs, policy_inputs, cfg)[0]

    # End to end: TRL's forward (fused LM head) + loss vs. our float64 forward + loss.
    names, params = zip(*model.named_parameters(), strict=True)
    params = list(params)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_grads = _grads(trl_loss, params)
    logits = _grpo_logits(model, batch.ids, batch.attention, trainer.temperature)
    loss = ours_loss(selective_logprobs(logits, inputs["completion_ids"]))
    assert_close(loss, trl_loss, **E2E)
    _assert_grads_close(_grads(loss, params), trl_grads, names, **E2E)
    assert max(g.abs().max() for g in trl_grads) > 1e-3  # a real gradient, not a vacuous match

    # Loss math: the same float64 token logprobs on both sides.
    with _Float64LogProbs(model) as hooked:
        trl_loss = trainer._compute_loss(model, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, hooked.leaf)
    loss = ours_loss(hooked.leaf[:, -T:])
    (grad,) = torch.autograd.grad(loss, hooked.leaf)
    assert_close(loss, trl_loss, **EXACT)
    assert_close(grad, trl_grad, **EXACT)


@pytest.fixture(scope="module")
def grpo_bf16(model_dir, tmp_path_factory):
    """TRL's GRPOTrainer and ours under TRL's own ``bf16=True`` (Accelerate's autocast over fp32 weights)."""
    args = _grpo_args(tmp_path_factory, "grpo_bf16", bf16=True, loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    common = _grpo_inputs(model_dir, args)
    loss = LossConfig(policy=policy_config(name="dapo", clip_low=0.2, clip_high=0.28))
    trainers = GRPOTrainer(**common), ComposerGRPOTrainer(loss=loss, **common)
    for trainer in trainers:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    return trainers


def test_under_trls_bf16_our_loss_is_trls_and_both_are_within_bf16_of_float64(grpo, grpo_bf16):
    """TRL's ``bf16=True`` is what the trl inner loop uses for ``precision: bf16``: the same
    autocast forward feeds both losses, which agree to fp32 error; against the float64
    forward they agree to bf16 error."""
    _, float64_model, batch = grpo
    theirs, ours = grpo_bf16
    assert theirs.accelerator.mixed_precision == "bf16" and theirs.model.dtype == torch.float32
    inputs = dict(batch.inputs, old_per_token_logps=batch.old["token"].float(), num_items_in_batch=batch.mask.sum())
    inputs["advantages"] = inputs["advantages"].float()
    results = []
    for trainer in (theirs, ours):
        loss = trainer._compute_loss(trainer.model, inputs)
        results.append((loss, _grads(loss, list(trainer.model.parameters()))))
    (trl_loss, trl_grads), (loss, grads) = results
    assert_close(loss, trl_loss, atol=1e-6, rtol=0.0)
    for a, b in zip(grads, trl_grads, strict=True):
        assert_close(a, b, atol=1e-6, rtol=0.0)

    logits = _grpo_logits(float64_model, batch.ids, batch.attention, theirs.temperature)
    counts = Counts.from_mask(batch.mask, max_len=theirs.max_completion_length)
    policy = PolicyInputs(batch.mask, batch.inputs["advantages"], counts, old_logprobs=batch.old["token"])
    dapo = policy_config(name="dapo", clip_low=0.2, clip_high=0.28)
    exact = policy_loss(selective_logprobs(logits, batch.inputs["completion_ids"]), policy, dapo)[0]
    exact_grads = _grads(exact, list(float64_model.parameters()))
    assert_close(loss.double(), exact, atol=BF16_LOSS, rtol=0.0)
    error = sum(float((g.double() - e).norm() ** 2) for g, e in zip(grads, exact_grads, strict=True))
    assert (error / sum(float(e.norm() ** 2) for e in exact_grads)) ** 0.5 <= BF16_GRADIENT


# ----------------------------------------------------------------------------- 2. GKD's JSD


@pytest.mark.parametrize("num_items", [False, True], ids=["batchmean", "num_items_in_batch"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_jsd_matches_trl_generalized_jsd_loss(beta, temperature, num_items):
    g = torch.Generator().manual_seed(7)
    batch, length, vocab = 3, 5, 11
    student = (2 * torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 2 * torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    labels[0, :2] = -100  # prompt
    labels[1, 3:] = -100  # padding
    labels[2, 1] = -100
    mask = labels != -100

    kwargs = dict(labels=labels, beta=beta, temperature=temperature)
    if num_items:  # global count over accumulated micro-batches
        kwargs["num_items_in_batch"] = torch.tensor(int(mask.sum()) + 6)
        counts = Counts(tokens=int(mask.sum()) + 6, sequences=batch, max_len=length)
    else:
        counts = Counts.from_mask(mask)
    trl_loss = GKDTrainer.generalized_jsd_loss(student, teacher, **kwargs)
    (trl_grad,) = torch.autograd.grad(trl_loss, student)

    loss, _ = distill_loss(
        student,
        DistillInputs(teacher=TeacherLogits(teacher), mask=mask, counts=counts),
        DistillConfig(divergence="jsd", jsd_beta=beta, temperature=temperature),
    )
    (grad,) = torch.autograd.grad(loss, student)
    assert trl_loss.item() > 1e-3
    assert_close(loss, trl_loss, **EXACT)
    assert_close(grad, trl_grad, **EXACT)
    assert grad[~mask].abs().max() == 0


def test_sampled_token_kl_has_the_gradient_of_trls_sdpo_sampled_token_loss():
    """TRL's SDPO ``distillation_mode="sampled_token"`` per-token loss ``sg[log S(y) - log T(y)] log S(y)``, as a
    masked token mean: ours has its gradient, and as its value the mean ``log S(y) - log T(y)`` (TRL's is not the KL)."""
    g = torch.Generator().manual_seed(11)
    batch, length, vocab = 3, 5, 11
    student = (2 * torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 2 * torch.randn(batch, length, vocab, generator=g, dtype=torch.float64)
    completion = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.rand(batch, length, generator=g) < 0.7
    per_token = compute_sampled_token_self_distillation_loss(student, teacher, completion, distillation_alpha=1.0)
    trl_loss = per_token[mask].sum() / mask.sum()
    (trl_grad,) = torch.autograd.grad(trl_loss, student)

    loss, metrics = distill_loss(
        student,
        DistillInputs(teacher=TeacherLogits(teacher), mask=mask, counts=Counts.from_mask(mask)),
        DistillConfig(divergence="sampled_kl_student_teacher"),
        targets=completion,
    )
    (grad,) = torch.autograd.grad(loss, student)
    log_ratio = selective_logprobs(student, completion) - selective_logprobs(teacher, completion)
    assert_close(loss, log_ratio[mask].mean().detach(), **EXACT)
    assert_close(grad, trl_grad, **EXACT)
    assert trl_grad.abs().max() > 1e-3 and grad[~mask].abs().max() == 0
    assert metrics["sampled_known"] == 1.0  # a full-logit teacher scores every token


# ----------------------------------------------------------------------------- 3. DPO (sigmoid)

PREFERENCE_DATA = {
    "prompt": ["abc", "hello ", "x", "the cat "],
    "chosen": ["def", "world", "yz12", "sat"],
    "rejected": ["q", "there friend", "w", "ran off now"],
}


@pytest.fixture(scope="module")
def dpo(model_dir, tmp_path_factory):
    args = DPOConfig(**_common_args(tmp_path_factory, "dpo"), loss_type=["sigmoid"])
    trainer = DPOTrainer(model=model_dir, args=args, train_dataset=datasets.Dataset.from_dict(PREFERENCE_DATA))
    return trainer, _float64_train(trainer)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_sigmoid_matches_trl_compute_loss(dpo, beta):
    """DPO's sigmoid loss lives only inside ``DPOTrainer._compute_loss`` (which runs the model), so the
    real trainer runs it; the reference sums come in the batch (``precompute_ref_logps``)."""
    trainer, model = dpo
    trainer.beta = beta
    trainer.loss_types, trainer.loss_weights = ["sigmoid"], [1.0]
    trainer.f_divergence_type = "reverse_kl"
    trainer.ld_alpha = None
    trainer.use_weighting = False
    trainer.precompute_ref_logps = True

    pairs = len(PREFERENCE_DATA["prompt"])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(pairs)])  # rows: [chosen; rejected]
    ids, attention, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    shift_mask = completion[:, 1:].bool()
    lengths = shift_mask.sum(-1)
    assert len(set(lengths.tolist())) > 2 and (attention == 0).any()  # varied lengths, real padding

    with torch.no_grad():
        logps = selective_logprobs(model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:])
        sums = torch.where(shift_mask, logps, 0.0).sum(-1)
    g = torch.Generator().manual_seed(3)
    ref = sums + torch.empty(2 * pairs, dtype=torch.float64).uniform_(-8.0, 8.0, generator=g)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref.chunk(2)

    def ours_loss(chosen, rejected):
        inputs = PreferenceInputs(
            chosen_logps=chosen,
            rejected_logps=rejected,
            chosen_lengths=lengths[:pairs],
            rejected_lengths=lengths[pairs:],
            num_pairs=pairs,
            ref_chosen_logps=batch["ref_chosen_logps"],
            ref_rejected_logps=batch["ref_rejected_logps"],
        )
        return preference_loss(inputs, PreferenceConfig(kind="dpo", dpo_beta=beta))[0]

    # End to end.
    names, params = zip(*model.named_parameters(), strict=True)
    params = list(params)
    trl_loss = trainer._compute_loss(model, batch, return_outputs=False)
    trl_grads = _grads(trl_loss, params)
    logps = selective_logprobs(model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:])
    chosen, rejected = torch.where(shift_mask, logps, 0.0).sum(-1).chunk(2)
    loss = ours_loss(chosen, rejected)
    assert_close(loss, trl_loss, **E2E)
    _assert_grads_close(_grads(loss, params), trl_grads, names, **E2E)
    assert max(g.abs().max() for g in trl_grads) > 1e-3

    # Loss math, gradients w.r.t. the chosen/rejected summed logps: TRL sums ``log_probs`` over the
    # whole row (the fused head zeroes non-completion positions, upstream of the hook), so its
    # gradient w.r.t. each completion token's logprob is the gradient w.r.t. that row's sum.
    with _Float64LogProbs(model) as hooked:
        trl_loss = trainer._compute_loss(model, batch, return_outputs=False)
    assert hooked.leaf.shape == shift_mask.shape
    assert hooked.leaf.detach()[~shift_mask].abs().max() == 0
    (trl_grad,) = torch.autograd.grad(trl_loss, hooked.leaf)
    chosen, rejected = (x.clone().requires_grad_() for x in hooked.leaf.detach().sum(-1).chunk(2))
    loss = ours_loss(chosen, rejected)
    grad = torch.cat(torch.autograd.grad(loss, [chosen, rejected]))
    assert_close(loss, trl_loss, **EXACT)
    assert_close(trl_grad * shift_mask, grad[:, None] * shift_mask, **EXACT)


# ----------------------------------------------------------------------------- 4. SimPO

SIMPO_CASES = [(2.0, 0.5), (2.5, 1.4), (1.0, 0.0)]  # (beta, gamma)


@pytest.fixture(scope="module")
def cpo(model_dir, tmp_path_factory):
    args = CPOConfig(**_common_args(tmp_path_factory, "cpo"), loss_type="simpo", cpo_alpha=0.0)
    trainer = CPOTrainer(model=model_dir, args=args, train_dataset=datasets.Dataset.from_dict(PREFERENCE_DATA))
    return trainer, _float64_train(trainer)


def _set_simpo(trainer, beta, gamma):
    trainer.loss_type, trainer.beta, trainer.simpo_gamma = "simpo", beta, gamma
    trainer.label_smoothing, trainer.alpha, trainer.cpo_alpha = 0.0, 0.0, 0.0


def _simpo_config(beta, gamma):
    # TRL: -logsigmoid(beta * (avg_c - avg_r - gamma / beta)); ours: -logsigmoid(beta * (avg_c - avg_r) - gamma).
    return PreferenceConfig(kind="simpo", simpo_beta=beta, simpo_gamma=gamma)


@pytest.mark.parametrize(("beta", "gamma"), SIMPO_CASES)
def test_simpo_matches_trl_cpo_loss(cpo, beta, gamma):
    """``cpo_loss`` takes length-averaged logps for SimPO (``get_batch_logps(average_log_prob=True)``),
    ours takes sums and lengths; the trainer reduces its per-pair losses with ``.mean()``."""
    trainer, _ = cpo
    _set_simpo(trainer, beta, gamma)
    g = torch.Generator().manual_seed(11)
    pairs = 8
    chosen_lengths = torch.randint(1, 12, (pairs,), generator=g)
    rejected_lengths = torch.randint(1, 12, (pairs,), generator=g)
    per_token = torch.empty(2, pairs, dtype=torch.float64).uniform_(0.5, 3.0, generator=g)
    chosen = (-chosen_lengths * per_token[0]).requires_grad_()  # summed logps
    rejected = (-rejected_lengths * per_token[1]).requires_grad_()

    losses, _, _ = trainer.cpo_loss(chosen / chosen_lengths, rejected / rejected_lengths)
    trl_loss = losses.mean()
    trl_grads = torch.autograd.grad(trl_loss, [chosen, rejected])

    inputs = PreferenceInputs(chosen, rejected, chosen_lengths, rejected_lengths, num_pairs=pairs)
    loss, _ = preference_loss(inputs, _simpo_config(beta, gamma))
    grads = torch.autograd.grad(loss, [chosen, rejected])
    assert_close(loss, trl_loss, **EXACT)
    for a, b in zip(grads, trl_grads, strict=True):
        assert_close(a, b, **EXACT)
    assert min(g.abs().min() for g in trl_grads) > 0


@pytest.mark.parametrize(("beta", "gamma"), SIMPO_CASES[:2])
def test_simpo_matches_trl_cpo_trainer_end_to_end(cpo, beta, gamma):
    """``CPOTrainer.get_batch_loss_metrics`` (cpo_alpha=0: pure SimPO) on a collated batch, which runs the
    model with full float64 logits: TRL's own forward, averaging and reduction vs. ours."""
    trainer, model = cpo
    _set_simpo(trainer, beta, gamma)
    pairs = len(PREFERENCE_DATA["prompt"])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(pairs)])

    names, params = zip(*model.named_parameters(), strict=True)
    params = list(params)
    trl_loss, _ = trainer.get_batch_loss_metrics(model, batch)
    trl_grads = _grads(trl_loss, params)

    sides = {}
    for side in ("chosen", "rejected"):
        ids, labels = batch[f"{side}_input_ids"], batch[f"{side}_labels"][:, 1:]
        logits = model(input_ids=ids, attention_mask=batch[f"{side}_attention_mask"]).logits[:, :-1]
        mask = labels != -100
        logps = selective_logprobs(logits, labels.clamp(min=0))
        sides[side] = (torch.where(mask, logps, 0.0).sum(-1), mask.sum(-1))
    inputs = PreferenceInputs(
        chosen_logps=sides["chosen"][0],
        rejected_logps=sides["rejected"][0],
        chosen_lengths=sides["chosen"][1],
        rejected_lengths=sides["rejected"][1],
        num_pairs=pairs,
    )
    assert len(set(inputs.rejected_lengths.tolist())) > 2
    loss, _ = preference_loss(inputs, _simpo_config(beta, gamma))
    assert_close(loss, trl_loss, atol=1e-10, rtol=0.0)
    _assert_grads_close(_grads(loss, params), trl_grads, names, atol=1e-10, rtol=0.0)
    assert max(g.abs().max() for g in trl_grads) > 1e-3
