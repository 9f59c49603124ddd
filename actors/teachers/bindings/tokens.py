"""Teacher and student token ids: mapping one vocabulary onto the other, and top-k in student ids."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from actors.contract.top_k import TopK
from actors.teachers.bindings import BindingError
from actors.teachers.bindings.config import BindingConfig


def vocab_map(teacher_vocab: dict[str, int], student_vocab: dict[str, int], cfg: BindingConfig) -> Tensor | None:
    """``None`` when the vocabularies are the same; else teacher id -> student id (-1: none).

    Refuses a mismatch unless the config declares ``token_map: by_string``.
    """
    if teacher_vocab == student_vocab:
        return None
    if cfg.token_map != "by_string":
        only_teacher = sorted(set(teacher_vocab) - set(student_vocab))[:5]
        moved = sorted(t for t in set(teacher_vocab) & set(student_vocab) if teacher_vocab[t] != student_vocab[t])[:5]
        raise BindingError(
            f"the {cfg.kind} teacher's tokenizer differs from the student's ({len(teacher_vocab)} vs "
            f"{len(student_vocab)} tokens; teacher-only tokens {only_teacher}, tokens with other ids {moved}), so "
            "its logprobs would be read as the wrong tokens. Use a teacher with the student's tokenizer, or "
            "declare token_map: by_string to match tokens by their strings"
        )
    mapping = torch.full((max(teacher_vocab.values()) + 1,), -1, dtype=torch.long)
    for token, teacher_id in teacher_vocab.items():
        if token in student_vocab:
            mapping[teacher_id] = student_vocab[token]
    if not (mapping >= 0).any():
        raise BindingError(f"the {cfg.kind} teacher shares no token strings with the student; token_map cannot help")
    return mapping


def top_k_of(
    teacher_logprobs: Tensor, k: int, student_vocab_size: int, mapping: Tensor | None, sampled: list[int]
) -> TopK:
    """Top-k of a teacher's full ``[T, V_teacher]`` log-distribution, in student ids, each position's
    ``sampled`` token (the student's completion, student ids) among them.

    Where the sampled token is not among the k most likely, it takes the least likely one's
    place (the last column, so each row stays in descending order): the sampled-token
    divergence reads the teacher's exact logprob of it, and the others stay exact over any
    k distinct ids, the tail bucket holding the rest.
    """
    if mapping is not None:
        mapping = mapping.to(teacher_logprobs.device)
        student = teacher_logprobs.new_full((teacher_logprobs.shape[0], student_vocab_size), float("-inf"))
        known = mapping[: teacher_logprobs.shape[-1]] >= 0
        student[:, mapping[: teacher_logprobs.shape[-1]][known]] = teacher_logprobs[:, known]
        teacher_logprobs = student
    teacher_logprobs = teacher_logprobs.float()
    values, ids = teacher_logprobs.topk(min(k, teacher_logprobs.shape[-1]), dim=-1)
    sampled_ids = torch.as_tensor(sampled, dtype=torch.long, device=ids.device)
    missing = (ids != sampled_ids[:, None]).all(-1)
    ids[:, -1] = torch.where(missing, sampled_ids, ids[:, -1])
    values[:, -1] = torch.where(missing, teacher_logprobs.gather(-1, sampled_ids[:, None]).squeeze(-1), values[:, -1])
    return TopK(ids.cpu().numpy().astype(np.int64), values.cpu().numpy().astype(np.float32))


def top_k_from_entries(entries: list[dict[int, float]], k: int, student_vocab_size: int, sampled: list[int]) -> TopK:
    """``TopK`` from per-position ``{student id: logprob}`` (e.g. an API's top logprobs).

    Keeps the k most likely, with each position's ``sampled`` token in place of the least
    likely where its entry has it (as ``top_k_of``; an entry may lack it, and then so do
    the ids), then fills each row to exactly ``min(k, V)`` distinct ids at ``-inf``.
    """
    width = min(k, student_vocab_size)
    ids = np.zeros((len(entries), width), dtype=np.int64)
    logprobs = np.full((len(entries), width), -np.inf, dtype=np.float32)
    for t, (entry, own) in enumerate(zip(entries, sampled, strict=True)):
        best = sorted(entry.items(), key=lambda item: -item[1])[:width]
        if own in entry and all(own != token for token, _ in best):
            best[-1] = (own, entry[own])
        taken = {token for token, _ in best}
        fill = (i for i in range(student_vocab_size) if i not in taken)
        for j in range(width):
            if j < len(best):
                ids[t, j], logprobs[t, j] = best[j]
            else:
                ids[t, j] = next(fill)
    return TopK(ids, logprobs)
