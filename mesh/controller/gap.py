"""The gap check (``loop.gap_check``): what the self-hinting distill teacher knows that its student does not,
measured before a fresh run's first step.

Channel 2's ``self_hint`` teacher is the policy re-reading the question with a hint; self-distillation can only
teach what that hinted self gets right more often than the student, and arXiv 2605.30070 found its gain follows
this gap before training. The collection (``SampleCollection.gap_check``) samples ``group_size`` completions of
training problems with the initial weights, rewards them, then samples the problems again with the hint the
teacher reads there (``hints.problem_hint``); this holds the two shares exactly right and says what they predict.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.controller.services import Rows

# Why a hint kind gives a problem no hint, as the summary says when it gives none any
NO_HINT = {
    "task": "the rewarder hints wrong samples only, and every sample was right",
    "answer": "none has a reference answer",
    "sibling": "it shows a right sample, and the student wrote none",
}


def exact_share(groups: Rows) -> float:
    """The share of the rows exactly right (a reward of 1 or more, as ``reward/exact`` counts)."""
    rows = [row for group in groups for row in group]
    return sum(row.reward.total >= 1.0 for row in rows) / len(rows)


@dataclass(frozen=True)
class GapCheck:
    """The student's and its hinted self's share exactly right on the ``checked`` problems (those the teacher's
    ``hint`` kind gives a hint, of the ``drawn``), ``samples`` completions of each; None where none was checked."""

    drawn: int
    checked: int
    samples: int  # per problem: the run's group_size
    hint: str  # the teacher's hint kind (``actors/teachers/bindings/config.py``)
    rlsd: bool  # channel 2 already rescales the policy gradient's tokens (``distill.signal: rlsd``)
    student: float | None = None
    hinted: float | None = None

    def metrics(self) -> dict[str, float]:
        """As logged at step -1: ``gap/problems`` (checked), ``gap/student`` and ``gap/hinted`` where there are."""
        shares = {} if self.student is None else {"gap/student": self.student, "gap/hinted": self.hinted}
        return {"gap/problems": self.checked} | shares

    def summary(self) -> str:
        """One paragraph: the two shares, their gap and what it predicts.

        A gap within one sample per problem (``1 / samples``) of zero counts as none: the hinted self then gets, on
        average, less than one more of a problem's samples right than the student, too little to teach."""
        if self.student is None:
            return (
                f"gap check: the teacher's hint ({self.hint}) gives none of the {self.drawn} problems a hint "
                f"({NO_HINT[self.hint]}), so there is no gap to measure"
            )
        every = self.checked == self.drawn
        on = f"{self.drawn} problems" if every else f"{self.checked} of {self.drawn} problems (those the teacher hints)"
        gap = self.hinted - self.student
        said = (
            f"gap check on {on} x {self.samples} samples: the student {self.student:.3f}, the policy with its hint "
            f"({self.hint}) {self.hinted:.3f}: a gap of {gap:+.3f}"
        )
        if gap >= 1 / self.samples:
            return f"{said}, so the self-hinting teacher knows more than its student (self-distillation can teach it)"
        why = "the hint makes the policy worse" if gap <= -1 / self.samples else "less than one sample per problem"
        instead = "" if self.rlsd else " or actors.trainer.loss.distill.signal: rlsd (the reward keeps the direction)"
        return (
            f"{said}: {why}, so the self-hinting teacher knows no more than its student and self-distillation is not "
            f"expected to help (arXiv 2605.30070); consider actors.trainer.loss.alpha_sdpo: 0{instead}"
        )
