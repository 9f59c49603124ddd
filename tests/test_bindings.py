"""Teacher bindings against their real backends: tiny HF models saved to disk, JSONL files.

(The ``openai`` binding has its own file, against a real HTTP server.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actors import registry
from actors.models.facts import TinyModelSpec
from actors.models.lora_config import LoRAConfig
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.tasks import Problem
from actors.teachers.bindings import (
    METHOD_OF_USE,
    BindingConfig,
    BindingError,
    Student,
    TopKRequest,
    check_binding_class,
    top_k_from_entries,
    top_k_of,
)
from actors.teachers.bindings import hf as hf_binding
from actors.teachers.bindings.hf import HFTeacher
from actors.teachers.bindings.replay import ReplayTeacher
from actors.teachers.bindings.self_hint import SelfHintTeacher
from actors.teachers.bindings.task_oracle import TaskOracle

ALPHABET = "abc="


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Student:
    path = build_tiny_model(tmp_path_factory.mktemp("student"), TinyModelSpec(), ALPHABET, seed=0)
    return Student(str(path), max_new_tokens=4, seed=0)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=96, layers=3)  # "a larger tiny model"
    return str(build_tiny_model(tmp_path_factory.mktemp("teacher"), spec, ALPHABET, seed=7))


def encode(model_dir: str, text: str) -> list[int]:
    return load_policy(model_dir)[1](text, add_special_tokens=False).input_ids


def distribution(model_dir: str, context: list[int], completion: list[int]) -> torch.Tensor:
    """The model's log-distribution at each position that predicts a completion token."""
    model, _ = load_policy(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([context + completion])).logits[0]
    return logits[len(context) - 1 : len(context) + len(completion) - 1].log_softmax(-1)


def assert_scores_are(scores, expected: torch.Tensor, k: int, completion: list[int]) -> None:
    """The teacher's own logprobs at its k most likely tokens, each position's completion token in place of the
    least likely where it is not among them."""
    ids = expected.topk(k, dim=-1).indices.numpy()
    own = np.array(completion)
    np.testing.assert_array_equal(scores.ids[:, :-1], ids[:, :-1])
    np.testing.assert_array_equal(scores.ids[:, -1], np.where((ids == own[:, None]).any(-1), ids[:, -1], own))
    np.testing.assert_allclose(scores.logprobs, expected.gather(-1, torch.from_numpy(scores.ids)).numpy(), atol=1e-5)


def test_hf_teacher_scores_the_students_tokens_with_its_own_distribution(student, teacher_dir):
    teacher = HFTeacher(BindingConfig("hf", use=("distill",), path=teacher_dir, top_k=3), student)
    completions = [[4, 5, 1], [6, 1]]
    scores = teacher.top_k([TopKRequest("abc=", completions[0]), TopKRequest("ab=", completions[1], hint="ba=")])
    expected = distribution(teacher_dir, encode(teacher_dir, "abc="), completions[0])
    assert_scores_are(scores[0], expected, 3, completions[0])
    # an hf teacher reads no hint: the second request is scored after its prompt alone
    expected = distribution(teacher_dir, encode(teacher_dir, "ab="), completions[1])
    assert_scores_are(scores[1], expected, 3, completions[1])


def test_a_long_completion_is_scored_a_chunk_of_positions_at_a_time(student, teacher_dir, monkeypatch):
    """The logits of at most SCORED_TOKENS positions exist at once: a completion longer than that (here 2) gets the
    same top-k as scored whole, beside a shorter one."""
    teacher = HFTeacher(BindingConfig("hf", use=("distill",), path=teacher_dir, top_k=3), student)
    requests = [TopKRequest("abc=", [4, 5, 6, 4, 1]), TopKRequest("ab=", [6])]
    monkeypatch.setattr(hf_binding, "SCORED_TOKENS", 2)
    chunked = teacher.top_k(requests)
    expected = distribution(teacher_dir, encode(teacher_dir, "abc="), requests[0].completion_ids)
    assert_scores_are(chunked[0], expected, 3, requests[0].completion_ids)
    assert chunked[1].ids.shape == (1, 3)


def test_a_top_k_beyond_the_vocabulary_is_the_whole_distribution(student, teacher_dir):
    teacher = HFTeacher(BindingConfig("hf", path=teacher_dir, top_k=100), student)
    (scores,) = teacher.top_k([TopKRequest("ab=", [5, 4, 1])])
    assert scores.ids.shape == (3, 7)  # 4 characters + 3 special tokens
    np.testing.assert_allclose(np.exp(scores.logprobs).sum(-1), 1.0, atol=1e-5)


def test_hf_teacher_traces_are_its_greedy_completions(student, teacher_dir):
    teacher = HFTeacher(BindingConfig("hf", use=("replay",), path=teacher_dir), student)
    problems = [Problem("abc=", "cba"), Problem("b=", "b")]
    model, tokenizer = load_policy(teacher_dir)
    expected = []
    for problem in problems:
        ids = torch.tensor([encode(teacher_dir, problem.prompt)])
        out = model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=0, eos_token_id=1)
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert teacher.trace(problems) == expected


def test_a_teacher_with_another_tokenizer_is_refused(student, tmp_path):
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(), "xyz=", seed=0)
    with pytest.raises(BindingError, match="tokenizer differs from the student's.*token_map: by_string"):
        HFTeacher(BindingConfig("hf", use=("distill",), path=str(other)), student)


def test_token_map_by_string_reads_a_permuted_vocabulary(student, tmp_path):
    """The same characters under other ids (``=cba`` builds them in another order)."""
    permuted = str(build_tiny_model(tmp_path / "permuted", TinyModelSpec(), "=cab", seed=3))
    student_vocab = load_policy(student.model_path)[1].get_vocab()
    teacher_vocab = load_policy(permuted)[1].get_vocab()
    assert teacher_vocab != student_vocab and set(teacher_vocab) == set(student_vocab)
    teacher = HFTeacher(BindingConfig("hf", path=permuted, top_k=7, token_map="by_string"), student)
    completion = [student_vocab[c] for c in "cba"] + [1]
    (scores,) = teacher.top_k([TopKRequest("abc=", completion)])
    in_teacher_ids = distribution(permuted, encode(permuted, "abc="), [teacher_vocab[c] for c in "cba"] + [1])
    to_student = {teacher_vocab[token]: student_vocab[token] for token in teacher_vocab}
    for t in range(len(completion)):
        for sid, logprob in zip(scores.ids[t], scores.logprobs[t]):
            tid = next(tid for tid, s in to_student.items() if s == sid)
            assert logprob == pytest.approx(float(in_teacher_ids[t, tid]), abs=1e-5)


def test_self_hint_teacher_is_the_policy_reading_the_hint(student):
    teacher = SelfHintTeacher(BindingConfig("self_hint", use=("distill",), top_k=7), student)
    completion = [6, 5, 4, 1]
    plain, hinted = teacher.top_k([TopKRequest("abc=", completion), TopKRequest("abc=", completion, hint="cba=")])
    prompt = encode(student.model_path, "abc=")
    # no hint: the student itself
    assert_scores_are(plain, distribution(student.model_path, prompt, completion), 7, completion)
    hinted_context = prompt + encode(student.model_path, "cba=")
    assert_scores_are(hinted, distribution(student.model_path, hinted_context, completion), 7, completion)
    assert not np.allclose(plain.logprobs, hinted.logprobs)


def test_self_hint_teacher_follows_the_weights_it_is_given(student):
    teacher = SelfHintTeacher(BindingConfig("self_hint", top_k=7), student)
    request = [TopKRequest("ab=", [5, 4, 1], hint="ba=")]
    before = teacher.top_k(request)[0].logprobs
    model, _ = load_policy(student.model_path)
    teacher.load_weights({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()})
    assert not np.allclose(teacher.top_k(request)[0].logprobs, before)


def shifted(model_dir: str, by: float) -> dict[str, torch.Tensor]:
    """The model's weights, each moved by ``by`` (a stand-in for a later policy version)."""
    model, _ = load_policy(model_dir)
    return {name: tensor + by for name, tensor in model.state_dict().items()}


def test_a_frozen_self_hint_teacher_never_follows_the_policy(student):
    teacher = SelfHintTeacher(BindingConfig("self_hint", top_k=7, weights="frozen"), student)
    live = SelfHintTeacher(BindingConfig("self_hint", top_k=7), student)
    assert not teacher.follows_policy and live.follows_policy  # the pool hands versions only to followers


def test_an_ema_self_hint_teacher_averages_the_versions_it_is_given(student):
    teacher = SelfHintTeacher(BindingConfig("self_hint", top_k=7, weights="ema", ema_rate=0.25), student)
    first, second = shifted(student.model_path, 0.0), shifted(student.model_path, 0.4)
    expected = {name: 0.75 * tensor + 0.25 * second[name] for name, tensor in first.items()}
    teacher.load_weights(first)  # the average starts at the first version
    teacher.load_weights(second)
    for tensor in [*first.values(), *second.values()]:  # the store's slots are reused: the teacher holds its own
        tensor.zero_()
    held = teacher.model.state_dict()
    for name, tensor in expected.items():  # a tied tensor (the embedding is the head here) is averaged once
        torch.testing.assert_close(held[name], tensor)


def test_an_ema_self_hint_teacher_is_refused_with_lora(student):
    with_lora = Student(student.model_path, student.max_new_tokens, student.seed, adapter=LoRAConfig(rank=2))
    with pytest.raises(BindingError, match="use weights: live or weights: frozen with LoRA"):
        SelfHintTeacher(BindingConfig("self_hint", weights="ema"), with_lora)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_self_hint_teacher_scores_on_the_gpu_its_weights_arrive_on(student):
    """Weights synced in place on a GPU (cuda_ipc) move the teacher there; its inputs must follow."""
    teacher = SelfHintTeacher(BindingConfig("self_hint", top_k=7), student)
    request = [TopKRequest("ab=", [5, 4, 1], hint="ba=")]
    on_cpu = teacher.top_k(request)[0]
    model, _ = load_policy(student.model_path)
    teacher.load_weights({k: v.cuda() for k, v in model.state_dict().items()})
    on_gpu = teacher.top_k(request)[0]
    np.testing.assert_array_equal(on_gpu.ids, on_cpu.ids)
    np.testing.assert_allclose(on_gpu.logprobs, on_cpu.logprobs, atol=1e-3)


def test_replay_teacher_replays_recorded_traces(student, tmp_path):
    path = tmp_path / "traces.jsonl"
    lines = [
        {"prompt": "abc=", "completion": "cba"},
        {"prompt": "abc=", "completion": "ccc"},
        {"prompt": "b=", "completion": "b"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    teacher = ReplayTeacher(BindingConfig("replay", use=("replay",), path=str(path)), student)
    problems = [Problem("abc=", "cba"), Problem("ca=", "ac"), Problem("b=", "b")]
    assert teacher.trace(problems) == ["cba", None, "b"]  # the first recorded trace; none for an unrecorded prompt


def test_a_corrupt_replay_file_names_its_line(student, tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"prompt": "a=", "completion": "a"}\n{"prompt": "b="}\n')
    with pytest.raises(BindingError, match=r"traces.jsonl:2 .*\"prompt\" and \"completion\""):
        ReplayTeacher(BindingConfig("replay", path=str(path)), student)
    with pytest.raises(ValueError, match="is not a file"):
        BindingConfig("replay", path=str(tmp_path / "missing.jsonl"))


def test_task_oracle_traces_the_answer(student):
    oracle = TaskOracle(BindingConfig("task_oracle"), student)
    assert oracle.trace([Problem("ab=", "ba")]) == ["ba"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "task_oracle", "use": ["distill"]}, "gives no top-k at the student's tokens"),
        ({"kind": "self_hint", "use": ["replay"]}, "writes no traces"),
        ({"kind": "task_oracle", "use": ["teach"]}, "unknown use 'teach'"),
        ({"kind": "hf"}, "needs path"),
        ({"kind": "hf", "path": "/nonexistent"}, "hf teacher path '/nonexistent' names nothing"),
        ({"kind": "self_hint", "top_k": 0}, "top_k must be an integer >= 1"),
        ({"kind": "self_hint", "path": "/x"}, "takes no path"),
        ({"kind": "self_hint", "weights": "slow"}, "unknown weights 'slow'"),
        ({"kind": "self_hint", "weights": "ema", "ema_rate": 0}, r"ema_rate is each new version's share .* \(0, 1\]"),
        ({"kind": "self_hint", "ema_rate": 0.1}, "ema_rate sets an EMA teacher's pace, but .* 'live'"),
        ({"kind": "self_hint", "hint": "solution"}, "unknown hint 'solution'"),
        ({"kind": "task_oracle", "hint": "sibling"}, "a task_oracle teacher has its own weights and reads no hint"),
        ({"kind": "nope"}, "unknown teacher 'nope'"),
    ],
)
def test_a_bad_binding_config_says_what_to_change(spec, message):
    with pytest.raises(ValueError, match=message):
        BindingConfig(**spec)


@pytest.mark.parametrize("kind", sorted(registry.BACKENDS["teacher"]))
def test_a_registered_teachers_uses_are_what_its_class_implements(kind):
    """The registry's metadata stands in for the class wherever a binding is only named."""
    binding_class, uses = registry.load("teacher", kind), registry.BACKENDS["teacher"][kind].uses
    assert uses == tuple(use for use, method in METHOD_OF_USE.items() if callable(getattr(binding_class, method, None)))
    check_binding_class(kind, binding_class, uses)


def test_entries_become_exactly_k_distinct_ids_with_zero_probability_fill():
    scores = top_k_from_entries([{3: -0.1, 5: -2.5, 0: -4.0}, {2: -0.01}], k=3, student_vocab_size=6, sampled=[5, 2])
    np.testing.assert_array_equal(scores.ids[0], [3, 5, 0])
    assert scores.ids[1][0] == 2 and len(set(scores.ids[1])) == 3
    assert np.isneginf(scores.logprobs[1][1:]).all()


def test_top_k_holds_the_sampled_token_in_place_of_the_least_likely():
    """The sampled-token divergence needs the teacher's exact logprob of the token the student sampled."""
    logprobs = torch.tensor([[0.0, -1.0, -2.0, -3.0, -4.0], [-4.0, -3.0, -2.0, 0.0, -1.0]]).log_softmax(-1)
    scores = top_k_of(logprobs, 3, 5, None, sampled=[4, 3])
    np.testing.assert_array_equal(scores.ids, [[0, 1, 4], [3, 4, 2]])  # row 1 already holds its token
    np.testing.assert_array_equal(scores.logprobs, logprobs.gather(-1, torch.tensor(scores.ids)).numpy())


def test_entries_hold_the_sampled_token_where_they_score_it():
    entries = [{3: -0.1, 5: -2.5, 0: -4.0, 1: -5.0}, {2: -0.01, 4: -6.0, 0: -7.0}]
    scores = top_k_from_entries(entries, k=2, student_vocab_size=6, sampled=[1, 5])
    np.testing.assert_array_equal(scores.ids[0], [3, 1])
    np.testing.assert_array_equal(scores.logprobs[0], np.float32([-0.1, -5.0]))
    np.testing.assert_array_equal(scores.ids[1], [2, 4])  # the API gave no logprob of token 5 there
