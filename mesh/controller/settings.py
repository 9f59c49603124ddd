"""The few settings the controller's parts read, taken once at construction (``mesh/runtime/run.py`` builds
them from the run's configuration), so no part reaches into the topology."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from losses.config import AdvantageEstimator, CovariancePolicyConfig
from mesh.controller.samples import SampleRecording


@dataclass(frozen=True)
class CollectSettings:
    """What a step's collection (and an evaluation) asks of the generators and teachers."""

    prompts_per_step: int
    group_size: int
    prompt_seed: int  # the training prompts' and their sampling's (a DiLoCo replica draws its own)
    seed: int  # the evaluation prompts' and their sampling's: the topology's, the same for every DiLoCo replica
    evaluation_prompts: int
    evaluation_greedy: bool  # each held-out prompt's argmax continuation rather than a sample
    warm_start_teacher: str | None  # whose traces join their prompts' groups (channel 1) ...
    warm_start_steps: int  # ... in the steps before this one
    replay: bool  # replay teachers' traces enter channel 3's pairs (``beta_replay > 0``)
    distill: bool  # the distill teacher's top-k is asked (``alpha_sdpo > 0``)
    distill_every_sample: bool = False  # for correct samples too (``distill.signal: rlsd`` rescales their tokens)
    by_group: bool = False  # an episode task's step takes the first groups to finish (``groups.py``)
    oracle: str | None = None  # an agent task's: the task_oracle binding its demonstrations stand for; None: none


@dataclass(frozen=True)
class LoopSettings:
    """What the loop around the collection needs: its length, the lag window, when to evaluate and
    checkpoint, and how a batch is built."""

    steps: int
    max_policy_lag: int
    evaluation_every: int  # 0: never
    evaluation_at_start: bool  # also evaluate the initial weights, before the first step (a run that starts afresh)
    gap_check_problems: int  # the training problems of the gap check before that step (``gap.py``); 0: none
    checkpoint_every: int  # 0: only the last step
    advantage: AdvantageEstimator | None
    max_completion_len: int  # the most tokens the model writes in one row (Dr. GRPO's normalizer)
    covariance: CovariancePolicyConfig | None  # the loss's Clip-Cov or KL-Cov rule (its tokens chosen per step)
    reference: bool  # whether the loss has a reference model (``time/reference`` is logged)
    diloco_interval: int | None  # inner steps per DiLoCo round (the trainer syncs); None: not a DiLoCo replica
    fingerprint: dict[str, Any]  # what a --resume must match, saved with every checkpoint
    collect: CollectSettings
    samples: SampleRecording | None = None  # which rows go to samples.jsonl; None: none
