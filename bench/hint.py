"""Benchmark: what a self-hinting teacher knows that its student does not, per hint wording (no training).

    python bench/hint.py               # smol_math.yaml's model and prompts, 32 problems x 4 samples
    python bench/hint.py --problems 8

SDPO's teacher is the policy itself re-reading the student's completion with a hint in its
context (``actors/teachers/bindings/self_hint.py``); the student learns toward the teacher's
distribution at each of its own tokens. That only helps where the hinted model knows better. For
each wrong completion of the policy (sampled as the generator samples), after its own tokens up to
where its final number starts (the one the verifier reads), this compares the probability of the
right number there under the student (no hint) and under the teacher with each hint wording, and
the mean divergence KL(student || teacher) per token over the whole completion: most of the
distillation signal, and not about the answer.

Then that divergence by token class: the tokens of the final number, of the other numbers and of the
wording (OPSD found style tokens carrying most of it). Then the gap check: the hinted policy's own
sampled accuracy against the student's, on the same problems, per hint (and with a correct sibling
sample as the hint, SDPO's demonstration, on the problems where the student wrote one). A self-teacher can only teach what it knows better: the gain
from self-distillation grows with this gap (arXiv 2605.30070), so a gap near zero predicts none.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch
from common import machine  # bench/ is on sys.path when this runs as a script

from actors.generator.engines import sampling_seeds
from actors.generator.engines.hf import HFEngine
from actors.models.chat import render
from actors.tasks import Problem, build_task
from actors.tasks.math import NUMBER, SOLUTION_HINT
from mesh.controller.hints import ANSWER_HINT, SIBLING_HINT
from mesh.topology.preflight import load_plan

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "topologies" / "smol_math.yaml"
SAMPLES = 4
CLASSES = ("the final answer", "other numbers", "the wording")  # token_classes' 0, 1, 2
HINTS = {  # wording -> where it goes (after the question, as the runtime renders a hint; or the system turn)
    "worked solution, after the question": ("user", SOLUTION_HINT),  # the runs' hint (hint: task)
    "the answer, after the question": ("user", ANSWER_HINT),  # hint: answer
    "worked solution, system turn": ("system", "{system}\nA worked solution of the problem:\n{solution}"),
}


def teacher_context(tokenizer, problem: Problem, where: str, wording: str) -> str:
    text = wording.format(solution=problem.solution, answer=problem.answer, system=problem.system_prompt)
    if where == "user":
        return render(tokenizer, problem.prompt, problem.system_prompt, text)
    return render(tokenizer, problem.prompt, text)


@torch.no_grad()
def logprobs(model, context_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log p(. | context, completion[:t]) at every completion position t: [T, V]."""
    ids = torch.tensor([context_ids + completion_ids])
    logits = model(input_ids=ids).logits[0, len(context_ids) - 1 : -1]
    return logits.float().log_softmax(-1)


def decoded(tokenizer, completion_ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The completion's text token by token, and each token's span of characters in it."""
    text, spans = "", []
    for token in completion_ids:
        piece = tokenizer.decode([token])
        spans.append((len(text), len(text) + len(piece)))
        text += piece
    return text, spans


def right_answer_after(tokenizer, problem: Problem, completion_ids: list[int]) -> tuple[list[int], list[int]] | None:
    """(the completion's tokens before the one where its last number starts, that token's text up to the
    number followed by the right answer, as tokens); None without a number."""
    text, spans = decoded(tokenizer, completion_ids)
    matches = list(NUMBER.finditer(text))
    if not matches:
        return None
    start = matches[-1].start(2)
    at = next(i for i, (a, b) in enumerate(spans) if a <= start < b)
    lead = text[spans[at][0] : start]
    return completion_ids[:at], tokenizer(lead + problem.answer, add_special_tokens=False).input_ids


def token_classes(tokenizer, completion_ids: list[int]) -> torch.Tensor:
    """Each completion token's class, ``[T]``: 0 where it spells the final number (the answer the verifier
    reads), 1 where it spells another number, 2 elsewhere (the wording)."""
    text, spans = decoded(tokenizer, completion_ids)
    numbers = [(m.start(2), m.end(2)) for m in NUMBER.finditer(text)]
    classes = [2 if not any(_overlap(span, n) for n in numbers) else 1 for span in spans]
    if numbers:
        classes = [0 if _overlap(span, numbers[-1]) else c for span, c in zip(spans, classes)]
    return torch.tensor(classes)


def _overlap(span: tuple[int, int], other: tuple[int, int]) -> bool:
    return span[0] < other[1] and other[0] < span[1]


def answer_probability(model, context_ids: list[int], prefix_ids: list[int], answer_ids: list[int]) -> float:
    scores = logprobs(model, context_ids, prefix_ids + answer_ids)[len(prefix_ids) :]
    return scores.gather(1, torch.tensor(answer_ids)[:, None]).sum().exp().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=32)
    args = parser.parse_args()
    plan = load_plan(TOPOLOGY, convert=True)
    topology = plan.topology
    task = build_task(topology.task.config)
    engine = HFEngine(str(plan.models["model.path"].directory()), topology.actors.generator.sampling)
    model, tokenizer = engine.model, engine.tokenizer
    problems = task.problems(topology.seed, 0, args.problems)
    prompts = [render(tokenizer, p.prompt, p.system_prompt) for p in problems]
    groups = engine.generate_now(prompts, SAMPLES, sampling_seeds(topology.seed, "hint bench", len(prompts)))
    right = {name: [] for name in ["student (no hint)", *HINTS]}
    divergence = {name: [] for name in HINTS}
    by_class = {name: torch.zeros(len(CLASSES)) for name in HINTS}  # the summed divergence per token class
    tokens = torch.zeros(len(CLASSES))
    wrong = 0
    for problem, prompt, group in zip(problems, prompts, groups):
        for sample in group:
            if task.reward(problem, sample.text) >= 1.0 or (cut := right_answer_after(tokenizer, problem, sample.completion_ids)) is None:
                continue
            wrong += 1
            context = tokenizer(prompt, add_special_tokens=False).input_ids
            student = logprobs(model, context, sample.completion_ids)
            classes = token_classes(tokenizer, sample.completion_ids)
            tokens += torch.bincount(classes, minlength=len(CLASSES))
            right["student (no hint)"].append(answer_probability(model, context, *cut))
            for name, (where, wording) in HINTS.items():
                hinted = tokenizer(teacher_context(tokenizer, problem, where, wording), add_special_tokens=False).input_ids
                teacher = logprobs(model, hinted, sample.completion_ids)
                right[name].append(answer_probability(model, hinted, *cut))
                kl = (student.exp() * (student - teacher)).sum(-1)  # KL(student || teacher) per position
                divergence[name].append(kl.mean().item())
                by_class[name] += torch.zeros(len(CLASSES)).index_add_(0, classes, kl)
    print(f"machine: {machine()}\ndate: {datetime.date.today()}")
    print(f"{wrong} wrong completions with a final number, of {len(problems) * SAMPLES} sampled")
    print("| context | P(right number) where the final number starts, median | mean | KL(student \\|\\| teacher) per token, median |")
    print("|---|---:|---:|---:|")
    for name, values in right.items():
        kl = f"{statistics.median(divergence[name]):.3f}" if name in divergence else ""
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.mean(values):.3f} | {kl} |")
    divergence_by_class(by_class, tokens)
    gap_check(engine, task, problems, groups, topology.seed)



def divergence_by_class(by_class: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
    """KL(student || teacher) per token of each class, pooled over the wrong completions, and each class's share of
    the whole divergence: where the distillation signal lies."""
    shares = ", ".join(f"{name} {count / tokens.sum():.0%}" for name, count in zip(CLASSES, tokens.tolist()))
    print(f"\ndivergence by token class (tokens: {shares})")
    print("| context | " + " | ".join(f"KL per token, {name}" for name in CLASSES) + " | the wording's share of it |")
    print("|---|" + "---:|" * (len(CLASSES) + 1))
    for name, sums in by_class.items():
        means = " | ".join(f"{value:.3f}" for value in (sums / tokens.clamp(min=1)).tolist())
        print(f"| {name} | {means} | {sums[2] / sums.sum():.0%} |")


def accuracy(task, problems: list[Problem], groups) -> float:
    return statistics.mean(task.reward(p, sample.text) >= 1.0 for p, group in zip(problems, groups) for sample in group)


def gap_check(engine: HFEngine, task, problems: list[Problem], groups, seed: int) -> None:
    """The hinted policy's sampled accuracy against the student's (``groups``, its samples of ``problems``)."""
    tokenizer, student = engine.tokenizer, accuracy(task, problems, groups)
    print(f"\ngap check: sampled accuracy, {len(problems)} problems x {SAMPLES} samples at the generator's sampling")
    print("| context | problems | student | hinted policy | gap |")
    print("|---|---:|---:|---:|---:|")
    for name, (where, wording) in HINTS.items():
        hinted = [teacher_context(tokenizer, p, where, wording) for p in problems]
        taught = accuracy(task, problems, engine.generate_now(hinted, SAMPLES, sampling_seeds(seed, name, len(hinted))))
        print(f"| {name} | {len(problems)} | {student:.3f} | {taught:.3f} | {taught - student:+.3f} |")
    right = [[task.reward(p, sample.text) >= 1.0 for sample in group] for p, group in zip(problems, groups)]
    solved = [i for i, marks in enumerate(right) if any(marks)]
    if not solved:
        print("| a correct sibling, after the question | 0 | | | |")
        return
    chosen = [problems[i] for i in solved]
    siblings = [groups[i][right[i].index(True)].text for i in solved]
    hinted = [
        render(tokenizer, p.prompt, p.system_prompt, SIBLING_HINT.format(completion=text))
        for p, text in zip(chosen, siblings)
    ]
    own = accuracy(task, chosen, [groups[i] for i in solved])
    taught = accuracy(task, chosen, engine.generate_now(hinted, SAMPLES, sampling_seeds(seed, "sibling", len(hinted))))
    print(f"| a correct sibling, after the question | {len(chosen)} | {own:.3f} | {taught:.3f} | {taught - own:+.3f} |")


if __name__ == "__main__":
    main()
