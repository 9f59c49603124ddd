"""The four inner loops compute one loss: same weights and batch, same loss and gradients.

Each loop is built from the same tiny HF model directory and runs ``forward_backward`` on
the same ``TrainBatch`` (ragged rows, micro-batches of 3, and with all three channels on:
teacher top-k on every other row and replayed-trace pairs). ``native`` in fp32 is the
reference: every loop matches it to float error in fp32, and to bf16 error in bf16. With LoRA,
the loops that train adapters (all but ``torchtitan``) match it on the adapters' gradients, from
the same adapters; each steps the adapters alone and resumes from its checkpoint exactly.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_actors import ALL_CHANNELS, TASK, a_batch
from torch.utils._python_dispatch import TorchDispatchMode

from actors import registry
from actors.contract.train_batch import TrainBatch
from actors.inner_loops.checkpoint import load_checkpoint
from actors.inner_loops.config import CustomLossConfig, OptimizerConfig, TrainerConfig
from actors.inner_loops.native import NativeLoop
from actors.models.facts import TinyModelSpec
from actors.models.lora import adapter_state, head_weight, load_adapter_state
from actors.models.lora_config import LoRAConfig
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from losses import LinearHead, LossConfig, policy_config, prime_rl
from losses.logprobs import token_logprobs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's config

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {  # beyond the plain methods: the sampler corrected apart from the ratio, truncated (TIS) or masked (MIS)
    "dapo_tis": policy_config(name="dapo", is_mode="token_truncate", is_max=1.5),
    "grpo_mis": policy_config(name="grpo", is_mode="token_mask", is_min=0.5, is_max=2.0),
    "grpo_dual_clip": policy_config(name="grpo", dual_clip=1.05),  # reaches every loop (PRIME-RL: as kwargs)
    "grpo_kl": policy_config(name="grpo", kl_coef=0.2),  # the batch carries reference logprobs (``native``)
    "dapo_kl_unbiased": policy_config(name="dapo", kl_coef=0.2, kl_unbiased=True),
    # the covariance rules at a tenth of each micro-batch's tokens, Clip-Cov's window opened wide
    "clip_cov": policy_config(name="clip_cov", cov_fraction=0.1, clip_cov_low=0.0, clip_cov_high=100.0),
    "kl_cov": policy_config(name="kl_cov", cov_fraction=0.1),
}
POLICY_LOSSES = ["dapo", "grpo", "dr_grpo", "gspo", "cispo", "dppo", "sapo", *POLICIES]
LOOPS = ["trl", "prime_rl", "torchtitan"]
PER_SAMPLE = ("clip_cov", "kl_cov")  # refused by prime_rl, whose loss sees one sample at a time
TOLERANCE = 1e-5  # fp32; the loops differ only in summation order (measured: <= 3e-8 for trl and prime_rl)
# bf16 against the fp32 reference (measured over every policy loss, with and without all channels: loss
# <= 7e-5 off, gradients <= 0.8% off in L2 and <= 6e-4 per entry where the largest is ~0.1). The first
# AdamW update is compared in L2 too (measured <= 11% off): that step is lr * g / |g| per entry, so an
# entry whose gradient lies within bf16 noise of 0 may move the other way.
BF16_LOSS, BF16_GRADIENT, BF16_GRADIENT_ENTRY, BF16_UPDATE = 2e-4, 0.015, 2e-3, 0.2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(), TASK.alphabet, seed=0))


def config(policy: str, channels: bool, **fields) -> TrainerConfig:
    loss = replace(ALL_CHANNELS if channels else LossConfig(), policy=POLICIES.get(policy) or policy_config(policy))
    return TrainerConfig(mesh="t", optimizer=OptimizerConfig(grad_clip=0), loss=loss, micro_batch_tokens=20, **fields)


def gradients_of(loop_name: str, model_dir: str, cfg: TrainerConfig, batch) -> tuple[dict, dict]:
    cfg = replace(cfg, inner_loop=loop_name)
    loop = registry.load("inner_loop", loop_name)(model_dir, cfg, rank=0, world=1)
    metrics = loop.forward_backward(batch, taid_t=0.6)
    return metrics, loop.gradients()


@pytest.fixture(scope="module")
def native(model_dir):
    """The reference loop's results, computed once per configuration."""
    cache = {}

    def results(policy: str, channels: bool):
        if (policy, channels) not in cache:
            batch = a_batch(model_dir, channels=channels)
            if policy in POLICIES and POLICIES[policy].kl_coef:
                batch = with_reference(batch)
            cache[policy, channels] = batch, gradients_of("native", model_dir, config(policy, channels), batch)
        return cache[policy, channels]

    return results


def with_reference(batch):
    """``batch`` with made-up reference logprobs: the sampler's, moved by up to +-0.5 per token."""
    noise = torch.rand(batch.inference_logprobs.shape, generator=torch.Generator().manual_seed(3)) - 0.5
    return replace(batch, ref_logprobs=batch.inference_logprobs + noise)


@pytest.mark.parametrize("channels", [False, True], ids=["policy", "all_channels"])
@pytest.mark.parametrize(
    ("loop", "policy"),
    [(loop, policy) for loop in LOOPS for policy in POLICY_LOSSES if not (loop == "prime_rl" and policy in PER_SAMPLE)],
)
def test_every_loop_gives_native_loss_and_gradients(loop, policy, channels, model_dir, native):
    batch, (want_metrics, want) = native(policy, channels)
    metrics, grads = gradients_of(loop, model_dir, config(policy, channels), batch)
    assert metrics["loss"] == pytest.approx(want_metrics["loss"], abs=TOLERANCE)
    if policy in POLICIES and POLICIES[policy].kl_coef:  # the penalty is in every loop's loss, not vanishingly small
        assert want_metrics["policy/kl"] > 0.05
        if loop != "prime_rl":  # PRIME-RL's metrics are means over samples, not tokens
            assert metrics["policy/kl"] == pytest.approx(want_metrics["policy/kl"], abs=TOLERANCE)
    for channel in ("policy", "distill", "preference"):
        assert metrics[f"{channel}/skipped"] == want_metrics[f"{channel}/skipped"]
        if not want_metrics[f"{channel}/skipped"]:
            assert metrics[f"{channel}/loss"] == pytest.approx(want_metrics[f"{channel}/loss"], abs=TOLERANCE)
    assert metrics["policy/entropy"] == pytest.approx(want_metrics["policy/entropy"], abs=TOLERANCE)
    assert want_metrics["policy/entropy"] > 0.1  # a random tiny model is far from certain
    assert sorted(grads) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(
            grads[name], grad, atol=TOLERANCE, rtol=0, msg=lambda m, name=name: f"{loop} {name}: {m}"
        )
    assert max(g.abs().max() for g in want.values()) > 1e-2  # a real gradient, not a vacuous match


class PaddedNative(NativeLoop):
    """The native loop as it was before packing: every row a sequence of its own, padded to the step's longest."""

    def head(self, batch):
        decoder = self.model.get_decoder()
        out = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        return LinearHead(out.last_hidden_state[:, batch.prompt_len - 1 : -1], head_weight(self.model))


@pytest.mark.parametrize("loop_name", ["native", "trl", "torchtitan"])
def test_each_micro_batch_is_packed_once_on_the_host_before_its_rows_move(loop_name, model_dir, monkeypatch):
    """Packing reads every token id (on a GPU, reading ids there waits for the device): each pass's rows, channel 3's
    included, are packed once from the share on the host and moved with that packing, which the head uses."""
    cfg = replace(config("grpo", True), inner_loop=loop_name)
    loop = registry.load("inner_loop", loop_name)(model_dir, cfg, rank=0, world=1)
    packed_rows, moved_with_packing, passes = [], [], []
    pack, to, packed = TrainBatch.packed, TrainBatch.to, loop.packed
    monkeypatch.setattr(TrainBatch, "packed", lambda self, lane=None: packed_rows.append(len(self)) or pack(self, lane))
    monkeypatch.setattr(TrainBatch, "to", lambda self, device: moved_with_packing.append(self.packing is not None)
                        or to(self, device))
    monkeypatch.setattr(loop, "packed", lambda batch: passes.append(batch.packing is not None) or packed(batch))
    loop.forward_backward(a_batch(model_dir, channels=True), taid_t=0.6)
    assert passes and all(passes)  # every read of a pass's packing found the one made before its rows moved
    assert len(packed_rows) == moved_with_packing.count(True)  # packed once each, only there
    assert sum(packed_rows) > len(a_batch(model_dir, channels=True))  # the policy's passes and channel 3's


@pytest.mark.parametrize("channels", [False, True], ids=["policy", "all_channels"])
@pytest.mark.parametrize("policy", POLICY_LOSSES)
def test_packed_rows_give_the_padded_rows_loss_and_gradients(policy, channels, model_dir, native, monkeypatch):
    """Packed micro-batches (each group's prompt once, actors/models/packing.py; completion columns trimmed) against the
    rows padded to the step's longest, as every loop ran before: the same loss and gradients to float error. Every
    other loop matches the packed native loop (above), so each matches its padded self too."""
    batch, (packed_metrics, packed_gradients) = native(policy, channels)
    monkeypatch.setattr(TrainBatch, "trimmed", lambda self: self)
    padded = PaddedNative(model_dir, config(policy, channels), rank=0, world=1)
    padded_metrics = padded.forward_backward(batch, taid_t=0.6)
    assert packed_metrics["loss"] == pytest.approx(padded_metrics["loss"], abs=TOLERANCE)
    assert relative_error(packed_gradients, padded.gradients()) <= TOLERANCE


def test_tis_inside_the_loop_weights_each_token_by_trainer_over_sampler(model_dir):
    """With ``is_mode`` set, the loop recomputes the trainer's logprobs (the ratio starts at 1)
    and weights each token's policy gradient by min(pi / mu, is_max); the mismatch is logged."""
    cfg = config("dapo_tis", channels=False)
    loop, by_hand = (registry.load("inner_loop", "native")(model_dir, cfg, rank=0, world=1) for _ in range(2))
    batch = a_batch(model_dir)
    head = by_hand.head(batch)
    logprobs = token_logprobs(head.hidden, head.weight, batch.targets)
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(0)) * 0.5
    batch = replace(batch, inference_logprobs=(logprobs.detach() + noise) * batch.completion_mask)  # a sampler near pi
    metrics = loop.forward_backward(batch)

    mask = batch.completion_mask & batch.policy_rows[:, None]
    log_r = torch.where(mask, logprobs.detach() - batch.inference_logprobs, 0.0)
    weight = log_r.exp().clamp(max=1.5)
    ratio = (logprobs - logprobs.detach()).exp()  # 1, with the gradient of the trainer's logprob
    loss = -(torch.where(mask, weight * batch.advantages[:, None] * ratio, 0.0)).sum() / mask.sum()  # DAPO token mean
    loss.backward()

    assert metrics["policy/loss"] == pytest.approx(loss.item(), abs=TOLERANCE)
    assert metrics["policy/ratio"] == pytest.approx(1.0, abs=1e-6) and metrics["policy/clipped_fraction"] == 0.0
    assert metrics["policy/is_weight"] == pytest.approx(float(weight[mask].mean()), abs=1e-6)
    assert 0.05 < float((weight[mask] == 1.5).float().mean()) < 0.5  # the truncation is actually exercised
    assert metrics["policy/mismatch_k1"] == pytest.approx(float(-log_r[mask].mean()), abs=1e-6)
    assert metrics["policy/mismatch_k3"] == pytest.approx(float((log_r.exp() - 1 - log_r)[mask].mean()), abs=1e-6)
    assert metrics["policy/mismatch_max"] == pytest.approx(float(log_r[mask].abs().max()), abs=1e-6)
    for name, grad in loop.gradients().items():
        torch.testing.assert_close(grad, by_hand.gradients()[name], atol=TOLERANCE, rtol=0, msg=name)


# ------------------------------------------------------------------------------------ bf16


def stepped(loop_name: str, model_dir: str, cfg: TrainerConfig, batch):
    """A fresh loop after one step on ``batch``, with the step's metrics and gradients."""
    loop = registry.load("inner_loop", loop_name)(model_dir, replace(cfg, inner_loop=loop_name), rank=0, world=1)
    metrics = loop.forward_backward(batch, taid_t=0.6)
    grads = {name: grad.clone() for name, grad in loop.gradients().items()}
    loop.clip_gradients()
    loop.optimizer_step()
    return loop, metrics, grads


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all the tensors together."""
    diff = sum(float((got[name] - want[name]).norm() ** 2) for name in want)
    return (diff / sum(float(tensor.norm() ** 2) for tensor in want.values())) ** 0.5


@pytest.fixture
def bf16_ready(request):
    """What a loop in bf16 needs here: the torchtitan loop's FSDP2 needs a process group, even of one."""

    def ready(loop: str) -> None:
        if loop == "torchtitan":
            request.getfixturevalue("process_group")

    return ready


@pytest.mark.parametrize("channels", [False, True], ids=["policy", "all_channels"])
@pytest.mark.parametrize("loop", ["native", *LOOPS])
def test_every_loop_in_bf16_takes_the_fp32_step_to_bf16_error(loop, channels, model_dir, bf16_ready):
    batch = a_batch(model_dir, channels=channels)
    initial = load_policy(model_dir)[0].state_dict()
    reference, want_metrics, want = stepped("native", model_dir, config("dapo", channels, precision="fp32"), batch)
    bf16_ready(loop)
    trained, metrics, grads = stepped(loop, model_dir, config("dapo", channels, precision="bf16"), batch)
    assert metrics["loss"] == pytest.approx(want_metrics["loss"], abs=BF16_LOSS)
    assert relative_error(grads, want) <= BF16_GRADIENT
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, atol=BF16_GRADIENT_ENTRY, rtol=0, msg=name)
    moved = {name: tensor - initial[name] for name, tensor in trained.state_dict().items()}
    want_moved = {name: tensor - initial[name] for name, tensor in reference.state_dict().items()}
    assert relative_error(moved, want_moved) <= BF16_UPDATE


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of the matrix products and attention kernels torch runs under it."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm") or name.startswith("_scaled_dot_product"):
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("precision", "dtype"), [("auto", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("loop", ["native", *LOOPS])
def test_precision_is_the_dtype_of_the_models_matmuls_and_masters_stay_fp32(
    loop, precision, dtype, model_dir, bf16_ready, tmp_path
):
    """On CPU, auto is fp32 and bf16 computes in bf16: every matrix product and attention of the
    policy's forward (counted in torch's dispatcher); weights, gradients, AdamW's moments and
    the checkpoint stay fp32."""
    bf16_ready(loop)
    cfg = replace(config("dapo", channels=False, precision=precision), inner_loop=loop)
    trained = registry.load("inner_loop", loop)(model_dir, cfg, rank=0, world=1)
    batch = a_batch(model_dir)
    with MatmulDtypes() as seen:
        trained.head(batch)
    assert seen.dtypes == {dtype}
    trained.train_step(batch)
    assert {grad.dtype for grad in trained.gradients().values()} == {torch.float32}
    trained.save(tmp_path / "ckpt", {"step": 1})
    weights, optimizer, _ = load_checkpoint(tmp_path / "ckpt")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    moments = [value for slots in optimizer["state"].values() for key, value in slots.items() if key != "step"]
    assert moments and {tensor.dtype for tensor in moments} == {torch.float32}


# ------------------------------------------------------------------------------------ trl


def test_trl_version_is_pinned_where_the_loop_checks_it():
    import trl

    from actors.inner_loops.trl import TRL_VERSION

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trl"]
    assert f"trl=={TRL_VERSION}" in extra
    assert trl.__version__ == TRL_VERSION


def test_composer_grpo_trainer_is_trls_loss_under_trls_own_training(model_dir, tmp_path):
    """The public subclass inside TRL's ``train()``: TRL generates, rewards and steps; the loss
    is ``compose_loss``, and on TRL's batch it equals TRL's own ``dapo`` loss."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from actors.inner_loops.trl import ComposerGRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        loss_type="dapo",
        epsilon_high=0.28,
    )
    common = {
        "reward_funcs": lambda completions, **kw: [float(c.count("a")) for c in completions],
        "args": args,
        "train_dataset": Dataset.from_dict({"prompt": ["abc", "cab", "bca", "acb"]}),
    }
    ours = ComposerGRPOTrainer(model=model_dir, loss=LossConfig(policy=policy_config(name="dapo")), **common)
    theirs = GRPOTrainer(model=model_dir, **common)
    ours.train()
    logged = [row for row in ours.state.log_history if "policy/loss" in row]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(row["policy/loss"])) for row in logged)

    # one of TRL's own batches, scored by both trainers from the same weights
    theirs.model.load_state_dict(ours.model.state_dict())
    batch = theirs._generate_and_score_completions([{"prompt": p} for p in ["abc"] * 4])
    for trainer in (ours, theirs):
        trainer.current_gradient_accumulation_steps = 1
    assert float(ours._compute_loss(ours.model, batch)) == pytest.approx(
        float(theirs._compute_loss(theirs.model, batch)), abs=1e-6
    )


# ------------------------------------------------------------------------------- prime_rl


def doubled(inputs: prime_rl.LossInputs, **kwargs) -> prime_rl.LossOutputs:
    """A PRIME-RL custom loss (imported by path in the test below): twice DAPO."""
    out = prime_rl.composer_loss(inputs, **kwargs)
    return prime_rl.LossOutputs(loss=2 * out.loss, metrics={"doubled": out.loss.detach()})


def test_prime_rl_custom_loss_by_import_path(model_dir, native):
    batch, (want_metrics, want) = native("dapo", False)
    custom = CustomLossConfig(import_path="test_inner_loops.doubled", kwargs={"name": "dapo"})
    metrics, grads = gradients_of(
        "prime_rl", model_dir, config("dapo", False, inner_loop="prime_rl", custom_loss=custom), batch
    )
    assert metrics["policy/loss"] == pytest.approx(2 * want_metrics["policy/loss"], abs=TOLERANCE)
    assert metrics["policy/doubled"] != 0  # the function's own metric, averaged over samples
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], 2 * grad, atol=2 * TOLERANCE, rtol=0)


def test_custom_loss_errors_say_what_to_change():
    custom = CustomLossConfig(import_path="losses.prime_rl.composer_loss")
    with pytest.raises(ValueError, match="set inner_loop: prime_rl"):
        TrainerConfig(mesh="t", custom_loss=custom)
    with pytest.raises(ValueError, match="'package.module.function'"):
        TrainerConfig(mesh="t", inner_loop="prime_rl", custom_loss=CustomLossConfig(import_path="no_such_pkg.loss"))


# ------------------------------------------------------------------------------------ LoRA

LORA = LoRAConfig(rank=4, alpha=8.0)
LORA_LOOPS = registry.able("inner_loop", "lora")  # every loop that declares it trains adapters


def lora_loop(loop_name: str, model_dir: str, cfg: TrainerConfig, adapters: dict | None = None, seed: int = 0):
    """A ``loop_name`` loop training ``LORA``'s adapters, built after ``torch.manual_seed(seed)`` as the trainer
    builds it; then given ``adapters`` (PEFT's saved names), if any."""
    torch.manual_seed(seed)
    loop = registry.load("inner_loop", loop_name)(model_dir, replace(cfg, inner_loop=loop_name, lora=LORA), 0, 1)
    if adapters is not None:
        load_adapter_state(loop.model, adapters)
    return loop


@pytest.fixture(scope="module")
def adapters(model_dir) -> dict[str, torch.Tensor]:
    """Adapters every loop is given: PEFT's init (A random, B zero) with B set to seeded values, so the base
    is not the policy and A's gradient is not zero."""
    initial = adapter_state(lora_loop("native", model_dir, config("dapo", False)).model)
    state = {name: tensor.clone() for name, tensor in initial.items()}
    gen = torch.Generator().manual_seed(1)
    for name, tensor in state.items():
        if ".lora_B." in name:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
    return state


@pytest.fixture(scope="module")
def lora_native(model_dir, adapters):
    """The reference LoRA loop's batch, metrics and adapter gradients, computed once per configuration."""
    cache = {}

    def results(policy: str, channels: bool):
        if (policy, channels) not in cache:
            batch = a_batch(model_dir, channels=channels)
            loop = lora_loop("native", model_dir, config(policy, channels), adapters)
            cache[policy, channels] = batch, loop.forward_backward(batch, taid_t=0.6), loop.gradients()
        return cache[policy, channels]

    return results


@pytest.mark.parametrize("channels", [False, True], ids=["policy", "all_channels"])
@pytest.mark.parametrize("policy", ["dapo", "gspo"])
@pytest.mark.parametrize("loop", ["trl", "prime_rl"])
def test_every_lora_loop_gives_native_loss_and_adapter_gradients(
    loop, policy, channels, model_dir, adapters, lora_native
):
    batch, want_metrics, want = lora_native(policy, channels)
    other = lora_loop(loop, model_dir, config(policy, channels), adapters)
    metrics, grads = other.forward_backward(batch, taid_t=0.6), other.gradients()
    assert metrics["loss"] == pytest.approx(want_metrics["loss"], abs=TOLERANCE)
    assert sorted(grads) == sorted(want) == sorted(adapters)  # the adapters', under PEFT's saved names, only
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, atol=TOLERANCE, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    for factor in ("lora_A", "lora_B"):  # both factors get a real gradient, not a vacuous match of zeros
        assert max(float(g.abs().max()) for n, g in want.items() if f".{factor}." in n) > 1e-3


@pytest.mark.parametrize("loop", LORA_LOOPS)
def test_every_lora_loop_in_bf16_gives_the_fp32_adapter_gradients_to_bf16_error(loop, model_dir, adapters):
    batch = a_batch(model_dir, channels=True)
    reference = lora_loop("native", model_dir, config("dapo", True, precision="fp32"), adapters)
    want_metrics, want = reference.forward_backward(batch, taid_t=0.6), reference.gradients()
    trained = lora_loop(loop, model_dir, config("dapo", True, precision="bf16"), adapters)
    metrics, grads = trained.forward_backward(batch, taid_t=0.6), trained.gradients()
    assert metrics["loss"] == pytest.approx(want_metrics["loss"], abs=BF16_LOSS)
    assert relative_error(grads, want) <= BF16_GRADIENT
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, atol=BF16_GRADIENT_ENTRY, rtol=0, msg=name)
    assert {param.dtype for param in trained.model.parameters()} == {torch.float32}  # fp32 masters, adapters too


@pytest.mark.parametrize("loop", LORA_LOOPS)
def test_a_lora_loop_trains_the_adapters_alone_from_the_seeds_adapters(loop, model_dir):
    """The optimizer holds the adapters only; a step leaves every base weight as it was; and the adapters
    start as PEFT's init under the trainer's seed, the same in every loop."""
    trained = lora_loop(loop, model_dir, config("dapo", False))
    start = adapter_state(lora_loop("native", model_dir, config("dapo", False)).model)
    assert adapter_state(trained.model).keys() == start.keys()
    for name, tensor in adapter_state(trained.model).items():
        assert torch.equal(tensor, start[name]), name
    optimized = [p for group in trained.optimizer.param_groups for p in group["params"]]
    adapter_params = [p for name, p in trained.model.named_parameters() if ".lora_" in name]
    assert len(optimized) == len(adapter_params) == len(start) > 0
    assert {id(p) for p in optimized} == {id(p) for p in adapter_params}
    assert all(not p.requires_grad for name, p in trained.model.named_parameters() if ".lora_" not in name)

    initial = load_policy(model_dir)[0].state_dict()
    trained.train_step(a_batch(model_dir))
    for name, param in trained.model.named_parameters():
        if ".lora_" not in name:
            base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(param, initial[base]), name
    moved = adapter_state(trained.model)
    assert any(not torch.equal(moved[name], start[name]) for name in start)


@pytest.mark.parametrize("loop", ["native", "trl"])
def test_a_lora_loop_resumed_from_its_checkpoint_steps_as_if_never_stopped(loop, model_dir, tmp_path):
    """Two steps straight, or one step, ``save``, ``load`` into a fresh loop (other adapters) and one more:
    the same adapters bitwise; the checkpoint's weights are the adapters alone."""
    cfg = config("dapo", False)
    batch = a_batch(model_dir)
    straight = lora_loop(loop, model_dir, cfg)
    for _ in range(2):
        straight.train_step(batch)
    first = lora_loop(loop, model_dir, cfg)
    first.train_step(batch)
    first.save(tmp_path / "ckpt", {"step": 1})
    weights, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert weights.keys() == adapter_state(first.model).keys() and all(".lora_" in name for name in weights)
    resumed = lora_loop(loop, model_dir, cfg, seed=1)
    assert resumed.load(tmp_path / "ckpt") == {"step": 1}
    resumed.train_step(batch)
    want = straight.state_dict()
    got = resumed.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
