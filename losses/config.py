"""Every knob of the three loss channels, as frozen dataclasses that import no torch.

The kernels (``policy.py``, ``distill.py``, ``preference.py``, ``compose.py``) read these;
keeping them apart means a topology can be checked, and its resolved values printed,
without loading torch. Invalid values and combinations fail when a config is built,
with a ``ValueError`` that names the fix.

Channel 1 has one config per method, ``PolicyConfig`` their union keyed by ``name``::

    BasePolicyConfig              what every method reads (aggregation, advantage, KL, IS weights)
    |- ClippedPolicyConfig        clip_low/high, dual_clip: grpo, dr_grpo, dapo, gspo, gspo_token
    |  '- + CovariancePolicyConfig                            clip_cov
    |- CovariancePolicyConfig     cov_fraction:               kl_cov
    '- cispo, dppo, sapo          each its own trust region

A method's class holds its published defaults. ``policy_config(name, ...)`` and a topology's
``loss.policy`` (``_ByName``) refuse a field the chosen method does not read, listing its fields.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

Aggregation = Literal["seq_mean_token_mean", "token_mean", "constant"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
AdvantageEstimator = Literal["group_std", "group_mean", "rloo"]


@dataclass(frozen=True)
class BasePolicyConfig:
    """The knobs every method of channel 1 reads; each method's own config adds its trust region's.

    - ``aggregation``: how per-token losses become the loss (``seq_mean_token_mean``,
      ``token_mean`` or ``constant``); each method defaults to its published one.
    - ``advantage``: how a group's rewards become advantages: ``group_std`` (GRPO's
      ``(r - mean) / (std + eps)``), ``group_mean`` (``r - mean``: Dr. GRPO, PRIME-RL) or
      ``rloo`` (``r - mean of the others``, leave-one-out); each method defaults to its own.
    - ``entropy_coef``: an entropy bonus (verl's ``entropy_coeff``): ``entropy_coef`` times the
      policy's token entropy, aggregated like the loss, is subtracted from it. Needs the
      whole distribution (not the ``prime_rl`` inner loop, whose loss sees token logprobs).
    - ``kl_coef``: beta of the k3 KL to the reference; ``kl_unbiased`` multiplies k3 by the
      ratio, which makes its gradient the unbiased ``grad KL(pi || ref)`` (DeepSeek-V3.2).
    - ``is_mode``: where the inference/trainer mismatch is corrected. Unset, the sampler's
      logprobs ``mu`` stand in for the old policy, so the ratio ``pi / mu`` carries the
      mismatch and the method's trust region bounds it (PRIME-RL's DPPO works this way).
      Set, the ratio is taken against the trainer's own logprobs before the update
      (recomputed by the trainer: the ratio starts at 1) and a separate detached weight
      ``pi_old / mu`` per token or per sequence (product over tokens), truncated at
      ``is_max`` (TIS) or masked to 0 outside ``[is_min, is_max]`` (MIS), corrects for
      the sampler (decoupled PPO).
    """

    name: str
    aggregation: Aggregation = "seq_mean_token_mean"
    advantage: AdvantageEstimator = "group_std"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_unbiased: bool = False
    is_mode: ISMode | None = None
    is_min: float = 0.0  # MIS: a weight below it masks its token (or sequence)
    is_max: float = 2.0  # TIS: the weight's cap; MIS: a weight above it masks its token (or sequence)

    def __post_init__(self) -> None:
        if POLICIES.get(self.name) is not type(self):
            raise ValueError(f"{type(self).__name__} is policy loss {_name_of(type(self))!r}, not {self.name!r}")
        if self.advantage not in ("group_std", "group_mean", "rloo"):
            raise ValueError(f"unknown advantage {self.advantage!r}; choose 'group_std', 'group_mean' or 'rloo'")
        if self.aggregation not in ("seq_mean_token_mean", "token_mean", "constant"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (a bonus for entropy), got {self.entropy_coef}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_unbiased and not self.kl_coef:
            raise ValueError("kl_unbiased corrects the KL penalty, so it needs kl_coef > 0")
        if self.is_mode is not None:
            if self.is_mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
                raise ValueError(f"unknown is_mode {self.is_mode!r}")
            if not 0 <= self.is_min < self.is_max:
                raise ValueError(f"importance weights need 0 <= is_min < is_max, got {self.is_min}, {self.is_max}")


@dataclass(frozen=True)
class ClippedPolicyConfig(BasePolicyConfig):
    """A method that clips the ratio, PPO's way (GRPO's defaults).

    - ``clip_low``/``clip_high``: the clip range ``[1 - clip_low, 1 + clip_high]``.
    - ``dual_clip``: dual-clip PPO's ``c`` (verl's ``clip_ratio_c``, published 3.0): for a
      negative advantage the token's loss is at most ``-c * A``, so a ratio that grew far
      past the clip range cannot blow the loss up. TRL's and Liger's ``delta``
      (INTELLECT-2's two-sided clipping, an upper clamp on the ratio) is the same loss for
      every ``delta > 1 + clip_high``, the only range INTELLECT-2 uses: set ``dual_clip``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(
                f"clip range needs 0 < clip_low < 1 and clip_high > 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c; 3.0 is published), got {self.dual_clip}")


@dataclass(frozen=True)
class CovariancePolicyConfig(BasePolicyConfig):
    """Clip-Cov and KL-Cov (arXiv 2505.22617, as verl implements them) hold back the tokens
    whose centred logprob times centred advantage (their covariance, which drives the
    policy's entropy down) is largest; ``cov_fraction`` (published 2e-4) is the share of the
    tokens held back, at least one. The tokens are chosen once per step (``covariance_selection``:
    over all its policy tokens, with the old policy's logprobs, the sampler's unless given),
    where verl chooses per micro-batch with the current logprobs (the same values in an
    on-policy first update): so micro-batch size, chunking and inner loop cannot change the
    choice. Not with the ``prime_rl`` inner loop, whose loss sees one sample at a time.
    """

    cov_fraction: float = 2e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.cov_fraction <= 1:
            raise ValueError(f"cov_fraction is a share of the tokens, in (0, 1], got {self.cov_fraction}")


@dataclass(frozen=True)
class GRPOPolicyConfig(ClippedPolicyConfig):
    """GRPO (DeepSeekMath, arXiv 2402.03300)."""

    name: Literal["grpo"] = "grpo"


@dataclass(frozen=True)
class DrGRPOPolicyConfig(ClippedPolicyConfig):
    """Dr. GRPO (arXiv 2503.20783): a constant normalizer, and no division by the group's std."""

    name: Literal["dr_grpo"] = "dr_grpo"
    aggregation: Aggregation = "constant"
    advantage: AdvantageEstimator = "group_mean"


@dataclass(frozen=True)
class DAPOPolicyConfig(ClippedPolicyConfig):
    """DAPO (arXiv 2503.14476): clip-higher and the token mean."""

    name: Literal["dapo"] = "dapo"
    aggregation: Aggregation = "token_mean"
    clip_high: float = 0.28


@dataclass(frozen=True)
class GSPOPolicyConfig(ClippedPolicyConfig):
    """GSPO (Qwen3, arXiv 2507.18071): the clip applies to the length-normalized sequence ratio."""

    name: Literal["gspo"] = "gspo"
    clip_low: float = 3e-4
    clip_high: float = 4e-4


@dataclass(frozen=True)
class GSPOTokenPolicyConfig(GSPOPolicyConfig):
    """GSPO-token: the sequence ratio's value with each token's own gradient."""

    name: Literal["gspo_token"] = "gspo_token"


@dataclass(frozen=True)
class CISPOPolicyConfig(BasePolicyConfig):
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``cispo_max_ratio`` is the IS-weight cap, an
    *absolute* cap ``sg(min(r, cispo_max_ratio))`` (the TRL/Liger convention; ScaleRL uses 5.0)."""

    name: Literal["cispo"] = "cispo"
    aggregation: Aggregation = "token_mean"
    cispo_max_ratio: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cispo_max_ratio <= 0:
            raise ValueError(f"cispo_max_ratio must be > 0, got {self.cispo_max_ratio}")


@dataclass(frozen=True)
class DPPOPolicyConfig(BasePolicyConfig):
    """PRIME-RL's default loss @559b44772, a probability-difference trust region: for A > 0 a
    token whose probability rose by more than ``dppo_mask_high`` gets no policy gradient, for
    A < 0 one that fell by more than ``dppo_mask_low``; plus ``dppo_kl_tau * log_ratio**2``,
    its own KL term, so the reference's (``kl_coef``) does not apply."""

    name: Literal["dppo"] = "dppo"
    aggregation: Aggregation = "token_mean"
    advantage: AdvantageEstimator = "group_mean"  # PRIME-RL centres on the group mean only
    kl_coef: ClassVar[float] = 0.0
    kl_unbiased: ClassVar[bool] = False
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    dppo_adv_tau: float = 1.0
    dppo_kl_tau: float = 1e-3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dppo_mask_low < 0 or self.dppo_mask_high < 0:
            raise ValueError(f"dppo_mask_low/high must be >= 0, got {self.dppo_mask_low}, {self.dppo_mask_high}")


@dataclass(frozen=True)
class SAPOPolicyConfig(BasePolicyConfig):
    """SAPO (arXiv 2511.20347, TRL's aggregation for it): the ratio's hard clip becomes the soft
    gate ``sigmoid(tau * (r - 1)) * 4 / tau``, whose slope is 1 at ``r = 1``, with temperature
    ``sapo_tau_pos`` for positive and ``sapo_tau_neg`` for non-positive advantages."""

    name: Literal["sapo"] = "sapo"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"SAPO's temperatures must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")


@dataclass(frozen=True)
class ClipCovPolicyConfig(ClippedPolicyConfig, CovariancePolicyConfig):
    """Clip-Cov: the clipped objective (verl's clip_ratio 0.2) with a random ``cov_fraction`` of
    the tokens, picked among those whose covariance lies in ``(clip_cov_low, clip_cov_high)``
    (published (1, 5)), cut from the loss where the clip left them alone. The random pick is
    seeded by its candidates, so retries and resumes agree."""

    name: Literal["clip_cov"] = "clip_cov"
    aggregation: Aggregation = "token_mean"  # verl's loss_agg_mode
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.clip_cov_low < self.clip_cov_high:
            raise ValueError(
                f"Clip-Cov's window needs clip_cov_low < clip_cov_high (published 1.0, 5.0), got "
                f"{self.clip_cov_low}, {self.clip_cov_high}"
            )


@dataclass(frozen=True)
class KLCovPolicyConfig(CovariancePolicyConfig):
    """KL-Cov: the unclipped ``-r * A`` with ``kl_cov_coef * |log r|`` (published 1) added at the
    ``cov_fraction`` of the tokens of largest covariance."""

    name: Literal["kl_cov"] = "kl_cov"
    aggregation: Aggregation = "token_mean"  # verl's loss_agg_mode
    kl_cov_coef: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_cov_coef < 0:
            raise ValueError(f"kl_cov_coef must be >= 0, got {self.kl_cov_coef}")


def _name_of(method: type) -> str:
    """The policy loss a config class is for: its ``name`` field's default."""
    return method.__dataclass_fields__["name"].default


PolicyConfig = (
    GRPOPolicyConfig
    | DrGRPOPolicyConfig
    | DAPOPolicyConfig
    | GSPOPolicyConfig
    | GSPOTokenPolicyConfig
    | CISPOPolicyConfig
    | DPPOPolicyConfig
    | SAPOPolicyConfig
    | ClipCovPolicyConfig
    | KLCovPolicyConfig
)
POLICIES: dict[str, type[BasePolicyConfig]] = {_name_of(method): method for method in typing.get_args(PolicyConfig)}
COVARIANCE = tuple(name for name, method in POLICIES.items() if issubclass(method, CovariancePolicyConfig))
DEFAULT_POLICY = "dapo"  # when the topology names none
# What a method that does not clip the ratio bounds it with instead.
TRUST_REGIONS = {
    "cispo": "cispo_max_ratio",
    "dppo": "dppo_mask_low/high",
    "sapo": "sapo_tau_pos/neg",
    "kl_cov": "kl_cov_coef",
}


def policy_fields(name: str) -> list[str]:
    """The keys policy loss ``name`` takes, sorted."""
    return sorted(field.name for field in dataclasses.fields(POLICIES[name]))


def check_fields(name: str, keys: Iterable[str]) -> None:
    """Refuses an unknown method, and a key that is not a field of method ``name``: naming the
    method's own fields, so that a knob of another method is never accepted and then ignored."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {', '.join(POLICIES)}")
    for key in sorted(set(keys) - set(policy_fields(name))):
        owners = [other for other in POLICIES if key in policy_fields(other)]
        if not owners:
            cause, fix = f"unknown key {key!r} (no policy loss has it)", "Fix the spelling or remove the key"
        else:
            cause = f"{key} does not apply to policy loss {name!r}"
            fix = f"Remove it, or set name to a method that reads it: {', '.join(owners)}"
            if key in ("clip_low", "clip_high", "dual_clip"):
                cause += f" ({name!r} does not clip the ratio; set {TRUST_REGIONS[name]} instead)"
            elif key in ("kl_coef", "kl_unbiased"):
                cause += f" ({name!r} has its own KL term, dppo_kl_tau)"
        raise ValueError(f"{cause}; the fields of {name!r} are: {', '.join(policy_fields(name))}. {fix}.")


def policy_config(name: str = DEFAULT_POLICY, **fields: Any) -> PolicyConfig:
    """The config of policy loss ``name`` (``DEFAULT_POLICY`` unless named) with ``fields`` set;
    a field that is not the method's is refused (``check_fields``)."""
    check_fields(name, fields)
    return POLICIES[name](**fields)


class _ByName:
    """How the topology's schema (pydantic) reads ``loss.policy``: as the config of the method
    its ``name`` names (``DEFAULT_POLICY`` when absent), after ``check_fields``. pydantic calls
    this while it builds the schema, so ``losses`` itself never imports pydantic."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic import Field
        from pydantic_core import core_schema

        by_name = handler.generate_schema(typing.Annotated[source, Field(discriminator="name")])
        return core_schema.no_info_wrap_validator_function(_validate_by_name, by_name)


def _validate_by_name(value: Any, validate: Any) -> Any:
    """``value`` checked by ``check_fields``, then validated as its method's config. pydantic
    names the union's member in an error's location; a key path has no such part, so it is
    dropped (``actors.trainer.loss.policy.clip_high``, not ``...policy.gspo.clip_high``)."""
    from pydantic import ValidationError

    if isinstance(value, dict):
        value = {"name": DEFAULT_POLICY} | value
        check_fields(value["name"], set(value) - {"name"})
    try:
        return validate(value)
    except ValidationError as error:
        untagged = [
            {"type": e["type"], "loc": e["loc"][1:], "input": e["input"]} | ({"ctx": e["ctx"]} if "ctx" in e else {})
            for e in error.errors()
        ]
        raise ValidationError.from_exception_data(error.title, untagged) from None


Divergence = Literal[
    "kl_teacher_student", "kl_student_teacher", "jsd", "taid", "entropy_opd", "sampled_kl_student_teacher"
]
SampleWeight = Literal["none", "entropy", "group_spread"]
Signal = Literal["divergence", "rlsd"]


@dataclass(frozen=True)
class DistillConfig:
    """Knobs of channel 2.

    - ``divergence``: ``kl_teacher_student`` (forward KL), ``kl_student_teacher``
      (reverse KL, on-policy distillation), ``jsd`` (generalized JSD: ``jsd_beta`` = 0 is
      KL(T||S), 1 is KL(S||T), as TRL's GKD), ``taid`` (KL to the interpolation of the
      detached student and the teacher at the loop's ``t``, arXiv 2501.16937),
      ``entropy_opd`` (reverse KL plus forward KL where the teacher is uncertain,
      arXiv 2603.07079), or ``sampled_kl_student_teacher`` (KL(S||T) estimated at the
      student's own sampled token y alone, as on-policy distillation and TRL's SDPO
      ``distillation_mode="sampled_token"``: the gradient ``sg[log S(y) - log T(y)] grad log S(y)``
      is unbiased for KL(S||T)'s, and the value is ``log S(y) - log T(y)``; a position whose
      teacher top-k lacks y carries no loss).
    - ``temperature``: both sides' logits are divided by it (full-logit teachers only).
    - ``token_clip``: per-token divergences above it are clipped (and get no gradient).
    - ``eopd_mode``: ``gate`` is the paper's hard indicator ``RKL + eopd_lambda *
      1[H_T > eopd_entropy] * FKL``; ``soft`` mixes ``(1-w) RKL + w FKL`` with
      ``w = clamp(H_T / eopd_entropy, 0, 1)``. ``eopd_entropy`` (nats) has no published
      default, so it must be set.
    - ``sample_weight``: a weight per distilled sample (row), as SRPO (arXiv 2604.02288) weights the
      failed samples it sends to self-distillation: ``none``; ``entropy``, ``exp(-H)`` with H the
      student's mean token entropy (nats) over the row's distilled tokens, so a confident sample's
      distillation counts more (a weight: no gradient flows through it); or ``group_spread``,
      ``sqrt(p (1 - p))`` with p the share of the row's group's policy samples that are correct
      (reward >= 1), so a group whose samples all agree contributes nothing. The weight multiplies the
      row's per-token divergences and the loss stays their mean over the distilled-token count, not
      over the weights' sum: renormalizing would undo the weights' scale (a step whose groups nearly
      all agree would be scaled back up to full strength, where ``group_spread`` means it to teach
      little), and the sum would be a second global count for every micro-batch to share.
    - ``signal``: what the teacher's distribution is used for. ``divergence`` (the default) trains the
      student toward it by the divergence above, weighted ``alpha_sdpo``. ``rlsd`` adds no loss of its
      own (RLSD, arXiv 2604.03128): the reward keeps the policy gradient's direction and the teacher only
      rescales each token's share of it. With ``delta = log T(y) - log S(y)`` at the student's sampled
      token y (detached), a token's advantage becomes ``A ((1 - alpha_sdpo) + alpha_sdpo w)``,
      ``w = clip(exp(sign(A) delta), 1 - rlsd_clip, 1 + rlsd_clip)``: a correct sample's tokens the
      hinted teacher favours and a wrong sample's tokens it disfavours count more. ``alpha_sdpo`` is the
      mix (1: the paper's form), so at most 1. A token whose teacher logprob is unknown (an API teacher's
      top-k without it) keeps weight 1. Needs only the sampled tokens' logprobs, so every head serves.
    - ``rlsd_clip``: ``w``'s clip range (``signal: rlsd`` only, and then required: no published default).
    """

    divergence: Divergence = "jsd"
    jsd_beta: float = 0.5
    temperature: float = 1.0
    token_clip: float | None = None
    eopd_mode: Literal["gate", "soft"] = "gate"
    eopd_entropy: float | None = None
    eopd_lambda: float = 1.0  # gate: the forward KL's weight where the teacher is uncertain
    sample_weight: SampleWeight = "none"
    signal: Signal = "divergence"
    rlsd_clip: float | None = None

    def __post_init__(self) -> None:
        if self.divergence not in typing.get_args(Divergence):
            known = ", ".join(typing.get_args(Divergence))
            raise ValueError(f"unknown divergence {self.divergence!r}; choose one of {known}")
        if self.sample_weight not in typing.get_args(SampleWeight):
            known = ", ".join(typing.get_args(SampleWeight))
            raise ValueError(f"unknown distill sample_weight {self.sample_weight!r}; choose one of {known}")
        self._check_signal()
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError(f"jsd_beta must be in [0, 1], got {self.jsd_beta}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.token_clip is not None and self.token_clip <= 0:
            raise ValueError(f"token_clip must be > 0 (or None), got {self.token_clip}")
        if self.eopd_mode not in ("gate", "soft"):
            raise ValueError(f"unknown eopd_mode {self.eopd_mode!r}; choose 'gate' or 'soft'")
        if self.divergence == "entropy_opd" and self.eopd_entropy is None:
            raise ValueError(
                "divergence 'entropy_opd' needs eopd_entropy, the teacher-entropy threshold in nats "
                "(no published default; log(V) is the maximum)"
            )
        if self.eopd_mode == "soft" and self.eopd_entropy is not None and self.eopd_entropy <= 0:
            raise ValueError("the soft entropy gate divides by eopd_entropy, so it must be > 0")

    def _check_signal(self) -> None:
        if self.signal not in typing.get_args(Signal):
            raise ValueError(f"unknown distill signal {self.signal!r}; choose 'divergence' or 'rlsd'")
        if self.signal == "divergence":
            if self.rlsd_clip is not None:
                raise ValueError("rlsd_clip is the clip of signal 'rlsd'; set signal: rlsd or remove rlsd_clip")
            return
        if self.rlsd_clip is None or not 0.0 < self.rlsd_clip < 1.0:
            raise ValueError(
                f"signal 'rlsd' needs rlsd_clip in (0, 1), the range its token weights are clipped to "
                f"(1 +- rlsd_clip), got {self.rlsd_clip}; the paper gives no default: 0.2, as PPO's clip, is a start"
            )
        divergence_knobs = {
            "token_clip": self.token_clip is not None,
            "sample_weight": self.sample_weight != "none",
            "temperature": self.temperature != 1.0,
        }
        if ignored := [name for name, is_set in divergence_knobs.items() if is_set]:
            raise ValueError(
                f"signal 'rlsd' adds no divergence, so {', '.join(ignored)} would do nothing: remove it, or use "
                "signal: divergence"
            )


@dataclass(frozen=True)
class PreferenceConfig:
    """Knobs of channel 3.

    - ``kind``: ``dpo`` (sigmoid DPO, arXiv 2305.18290, needs reference logprobs) or
      ``simpo`` (length-normalized and reference-free, arXiv 2405.14734; prefer it when
      teachers differ in verbosity).
    - ``simpo_gamma`` is the target margin gamma itself (TRL's ``simpo_gamma``); the
      official code's ``gamma_beta_ratio`` is ``simpo_gamma / simpo_beta``.
    """

    kind: Literal["dpo", "simpo"] = "dpo"
    dpo_beta: float = 0.1  # DPO's beta: the scale of its implicit reward
    simpo_beta: float = 2.0  # SimPO's beta: the scale of its length-normalized reward
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("dpo", "simpo"):
            raise ValueError(f"unknown preference loss {self.kind!r}; choose 'dpo' or 'simpo'")
        if self.dpo_beta <= 0 or self.simpo_beta <= 0:
            raise ValueError("dpo_beta and simpo_beta must be > 0")
        if self.simpo_gamma < 0:
            raise ValueError(f"simpo_gamma must be >= 0, got {self.simpo_gamma}")


@dataclass(frozen=True)
class LossConfig:
    """Every knob of the three-channel loss; invalid combinations fail when it is built.

    - ``policy``: channel 1, the config of one method (``policy_config(name, ...)``, or in a
      topology a mapping whose ``name`` picks the method); ``DEFAULT_POLICY`` unless set.
    - ``alpha_sdpo``: weight of channel 2 (distillation, e.g. SDPO hint self-distillation); under
      ``distill.signal: rlsd`` the mix of the teacher's token weights into the advantages, at most 1.
    - ``beta_replay``: weight of channel 3 (DPO/SimPO over teacher-trace pairs).
    - ``chunk_tokens``: with a ``LinearHead``, about this many tokens' logits exist at
      once (whole rows, longest first, each chunk as wide as its longest row; at least one row).
    """

    policy: Annotated[PolicyConfig, _ByName()] = field(default_factory=lambda: POLICIES[DEFAULT_POLICY]())
    distill: DistillConfig = field(default_factory=DistillConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    alpha_sdpo: float = 0.0
    beta_replay: float = 0.0
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        for name, kind in (("policy", BasePolicyConfig), ("distill", DistillConfig), ("preference", PreferenceConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"LossConfig.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                )
        if self.alpha_sdpo < 0 or self.beta_replay < 0:
            raise ValueError(
                f"channel weights must be >= 0, got alpha_sdpo={self.alpha_sdpo}, beta_replay={self.beta_replay}"
            )
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.distill.signal == "rlsd" and self.alpha_sdpo > 1:
            raise ValueError(
                f"under distill.signal 'rlsd', alpha_sdpo mixes the teacher's token weights into the advantages "
                f"(1 - alpha_sdpo) + alpha_sdpo w, so it must be in [0, 1], got {self.alpha_sdpo}"
            )
