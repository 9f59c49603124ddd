"""Every knob of the three loss channels, as frozen dataclasses that import no torch.

The kernels (``policy.py``, ``distill.py``, ``preference.py``, ``compose.py``) read these;
keeping them apart means a topology can be checked, and its resolved values printed,
without loading torch. Invalid values and combinations fail when a config is built,
with a ``ValueError`` that names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PolicyName = Literal["grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "cispo", "dppo", "sapo", "clip_cov", "kl_cov"]
Aggregation = Literal["seq_mean_token_mean", "token_mean", "constant"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
AdvantageEstimator = Literal["group_std", "group_mean", "rloo"]

CLIPPED = ("grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "clip_cov")
COVARIANCE = ("clip_cov", "kl_cov")  # pick tokens by the covariance of logprob and advantage
# Published defaults: (eps_low, eps_high, aggregation).
DEFAULTS: dict[str, tuple[float | None, float | None, Aggregation]] = {
    "grpo": (0.2, 0.2, "seq_mean_token_mean"),  # DeepSeekMath, arXiv 2402.03300
    "dr_grpo": (0.2, 0.2, "constant"),  # arXiv 2503.20783
    "dapo": (0.2, 0.28, "token_mean"),  # clip-higher, arXiv 2503.14476
    "gspo": (3e-4, 4e-4, "seq_mean_token_mean"),  # Qwen3, arXiv 2507.18071
    "gspo_token": (3e-4, 4e-4, "seq_mean_token_mean"),
    "cispo": (None, None, "token_mean"),  # MiniMax-M1, arXiv 2506.13585
    "dppo": (None, None, "token_mean"),  # PRIME-RL's default loss @559b44772
    "sapo": (None, None, "seq_mean_token_mean"),  # arXiv 2511.20347, TRL's aggregation for it
    "clip_cov": (0.2, 0.2, "token_mean"),  # arXiv 2505.22617, verl's clip_ratio and loss_agg_mode
    "kl_cov": (None, None, "token_mean"),
}
# Published advantage estimators: group-normalized (GRPO's) unless the method drops the std.
MEAN_CENTRED = ("dr_grpo", "dppo")  # Dr. GRPO removes the std; PRIME-RL centres on the group mean only


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of channel 1. ``None`` fields take the method's published default.

    - ``clip_low``/``clip_high``: PPO clip range ``[1 - clip_low, 1 + clip_high]``
      (clipped methods only).
    - ``dual_clip``: dual-clip PPO's ``c`` (verl's ``clip_ratio_c``, published 3.0): for a
      negative advantage the token's loss is at most ``-c * A``, so a ratio that grew far
      past the clip range cannot blow the loss up. TRL's and Liger's ``delta``
      (INTELLECT-2's two-sided clipping, an upper clamp on the ratio) is the same loss for
      every ``delta > 1 + clip_high``, the only range INTELLECT-2 uses: set ``dual_clip``.
      Clipped methods only.
    - ``sapo_tau_pos``/``sapo_tau_neg``: SAPO's temperatures for positive and non-positive
      advantages (published 1.0 and 1.05): the ratio's hard clip becomes the soft gate
      ``sigmoid(tau * (r - 1)) * 4 / tau``, whose slope is 1 at ``r = 1``.
    - ``clip_cov`` and ``kl_cov`` (arXiv 2505.22617, as verl implements them): the tokens
      whose centred logprob times centred advantage (their covariance, which drives the
      policy's entropy down) is largest are held back. ``clip_cov`` is the clipped
      objective with a random ``cov_fraction`` of the tokens (at least one), picked among
      those whose covariance lies in ``(clip_cov_low, clip_cov_high)``, cut from the loss
      where the clip left them alone; ``kl_cov`` is the unclipped ``-r * A`` with
      ``kl_cov_coef * |log r|`` added at the ``cov_fraction`` of the tokens (at least one)
      of largest covariance. Published: ``cov_fraction`` 2e-4, window (1, 5), ``kl_cov_coef``
      1. The tokens are chosen once per step (``covariance_selection``: over all its policy
      tokens, with the old policy's logprobs, the sampler's unless given), where verl
      chooses per micro-batch with the current logprobs (the same values in an on-policy
      first update): so micro-batch size, chunking and inner loop cannot change the choice.
      Clip-Cov's random pick is seeded by its candidates, so retries and resumes agree.
    - ``entropy_coef``: an entropy bonus (verl's ``entropy_coeff``): ``entropy_coef`` times the
      policy's token entropy, aggregated like the loss, is subtracted from it. Needs the
      whole distribution (not the ``prime_rl`` inner loop, whose loss sees token logprobs).
    - ``cispo_max_ratio``: CISPO's IS-weight cap, an *absolute* cap
      ``sg(min(r, cispo_max_ratio))`` (the TRL/Liger convention; ScaleRL uses 5.0).
    - ``dppo_*``: PRIME-RL's probability-difference trust region: for A > 0 a token whose
      probability rose by more than ``dppo_mask_high`` gets no policy gradient, for A < 0
      one that fell by more than ``dppo_mask_low``; plus ``dppo_kl_tau * log_ratio**2``.
    - ``advantage``: how a group's rewards become advantages: ``group_std`` (GRPO's
      ``(r - mean) / (std + eps)``), ``group_mean`` (``r - mean``: Dr. GRPO, PRIME-RL) or
      ``rloo`` (``r - mean of the others``, leave-one-out). Unset: the method's own.
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

    name: PolicyName = "dapo"
    clip_low: float | None = None
    clip_high: float | None = None
    aggregation: Aggregation | None = None
    advantage: AdvantageEstimator | None = None
    dual_clip: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_fraction: float = 2e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_unbiased: bool = False
    cispo_max_ratio: float = 5.0
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    dppo_adv_tau: float = 1.0
    dppo_kl_tau: float = 1e-3
    is_mode: ISMode | None = None
    is_min: float = 0.0
    is_max: float = 2.0

    def __post_init__(self) -> None:
        if self.name not in DEFAULTS:
            raise ValueError(f"unknown policy loss {self.name!r}; choose one of {sorted(DEFAULTS)}")
        low, high, aggregation = DEFAULTS[self.name]
        if self.name not in CLIPPED and (self.clip_low is not None or self.clip_high is not None):
            instead = {"cispo": "cispo_max_ratio", "sapo": "sapo_tau_pos/neg", "kl_cov": "kl_cov_coef"}.get(
                self.name, "dppo_mask_low/high"
            )
            raise ValueError(
                f"policy loss {self.name!r} does not clip the ratio, so clip_low/clip_high do not apply; "
                f"set {instead} instead."
            )
        object.__setattr__(self, "clip_low", low if self.clip_low is None else self.clip_low)
        object.__setattr__(self, "clip_high", high if self.clip_high is None else self.clip_high)
        object.__setattr__(self, "aggregation", self.aggregation or aggregation)
        published = "group_mean" if self.name in MEAN_CENTRED else "group_std"
        object.__setattr__(self, "advantage", self.advantage or published)
        if self.advantage not in ("group_std", "group_mean", "rloo"):
            raise ValueError(f"unknown advantage {self.advantage!r}; choose 'group_std', 'group_mean' or 'rloo'")
        if self.aggregation not in ("seq_mean_token_mean", "token_mean", "constant"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}")
        if self.name in CLIPPED and not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(
                f"clip range needs 0 < clip_low < 1 and clip_high > 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip is not None:
            if self.name not in CLIPPED:
                raise ValueError(f"dual_clip caps the clipped objective, and {self.name!r} does not clip; unset it")
            if not self.dual_clip > 1:
                raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c; 3.0 is published), got {self.dual_clip}")
        if not 0 < self.cov_fraction <= 1:
            raise ValueError(f"cov_fraction is a share of the tokens, in (0, 1], got {self.cov_fraction}")
        if not self.clip_cov_low < self.clip_cov_high or self.kl_cov_coef < 0:
            raise ValueError(
                f"Clip-Cov's window needs clip_cov_low < clip_cov_high (published 1.0, 5.0), got "
                f"{self.clip_cov_low}, {self.clip_cov_high}; kl_cov_coef must be >= 0, got {self.kl_cov_coef}"
            )
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"SAPO's temperatures must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if self.cispo_max_ratio <= 0 or self.dppo_mask_low < 0 or self.dppo_mask_high < 0:
            raise ValueError("cispo_max_ratio must be > 0 and dppo_mask_low/high >= 0")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (a bonus for entropy), got {self.entropy_coef}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_coef and self.name == "dppo":
            raise ValueError("dppo has its own KL term (dppo_kl_tau); leave kl_coef at 0")
        if self.kl_unbiased and not self.kl_coef:
            raise ValueError("kl_unbiased corrects the KL penalty, so it needs kl_coef > 0")
        if self.is_mode is not None:
            if self.is_mode not in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
                raise ValueError(f"unknown is_mode {self.is_mode!r}")
            if not 0 <= self.is_min < self.is_max:
                raise ValueError(f"importance weights need 0 <= is_min < is_max, got {self.is_min}, {self.is_max}")


Divergence = Literal["kl_teacher_student", "kl_student_teacher", "jsd", "taid", "entropy_opd"]


@dataclass(frozen=True)
class DistillConfig:
    """Knobs of channel 2.

    - ``divergence``: ``kl_teacher_student`` (forward KL), ``kl_student_teacher``
      (reverse KL, on-policy distillation), ``jsd`` (generalized JSD: ``jsd_beta`` = 0 is
      KL(T||S), 1 is KL(S||T), as TRL's GKD), ``taid`` (KL to the interpolation of the
      detached student and the teacher at the loop's ``t``, arXiv 2501.16937), or
      ``entropy_opd`` (reverse KL plus forward KL where the teacher is uncertain,
      arXiv 2603.07079).
    - ``temperature``: both sides' logits are divided by it (full-logit teachers only).
    - ``token_clip``: per-token divergences above it are clipped (and get no gradient).
    - ``eopd_mode``: ``gate`` is the paper's hard indicator ``RKL + eopd_lambda *
      1[H_T > eopd_entropy] * FKL``; ``soft`` mixes ``(1-w) RKL + w FKL`` with
      ``w = clamp(H_T / eopd_entropy, 0, 1)``. ``eopd_entropy`` (nats) has no published
      default, so it must be set.
    """

    divergence: Divergence = "jsd"
    jsd_beta: float = 0.5
    temperature: float = 1.0
    token_clip: float | None = None
    eopd_mode: Literal["gate", "soft"] = "gate"
    eopd_entropy: float | None = None
    eopd_lambda: float = 1.0

    def __post_init__(self) -> None:
        if self.divergence not in ("kl_teacher_student", "kl_student_teacher", "jsd", "taid", "entropy_opd"):
            raise ValueError(f"unknown divergence {self.divergence!r}")
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
    dpo_beta: float = 0.1
    simpo_beta: float = 2.0
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

    - ``alpha_sdpo``: weight of channel 2 (distillation, e.g. SDPO hint self-distillation).
    - ``beta_replay``: weight of channel 3 (DPO/SimPO over teacher-trace pairs).
    - ``chunk_tokens``: with a ``LinearHead``, about this many tokens' logits exist at
      once (rounded to whole rows, at least one row).
    """

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    alpha_sdpo: float = 0.0
    beta_replay: float = 0.0
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        for name, kind in (("policy", PolicyConfig), ("distill", DistillConfig), ("preference", PreferenceConfig)):
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
