"""The ``dataset`` task: prompts from local files and saved data sets, read with ``datasets`` offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from actors.tasks import Problem, TaskConfig, build_task
from actors.tasks.dataset import DatasetError, DatasetSource, DatasetTask
from mesh.topology.schema import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"q": f"What is {i} + 1?", "a": i + 1, "note": "x"} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pairs(rows: list[dict]) -> set[tuple[str, str]]:
    return {(row["q"], str(row["a"])) for row in rows}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """The same rows as parquet, a saved Dataset, a saved DatasetDict (train/test) and split files."""
    import datasets

    root = tmp_path_factory.mktemp("data")
    data = datasets.Dataset.from_list(ROWS)
    data.to_parquet(str(root / "rows.parquet"))
    data.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": data, "test": data.select(range(3))}).save_to_disk(str(root / "saved_dict"))
    (root / "by_split" / "data").mkdir(parents=True)
    write_jsonl(root / "by_split" / "data" / "train-00000-of-00001.jsonl", ROWS[:6])
    write_jsonl(root / "by_split" / "data" / "test-00000-of-00001.jsonl", ROWS[6:])
    return {
        "jsonl": write_jsonl(root / "rows.jsonl", ROWS),
        "parquet": root / "rows.parquet",
        "saved": root / "saved",
        "saved_dict": root / "saved_dict",
        "by_split": root / "by_split",
    }


@pytest.mark.parametrize(
    ("kind", "split", "expected"),
    [
        ("jsonl", None, ROWS),
        ("parquet", None, ROWS),
        ("saved", None, ROWS),
        ("saved_dict", "test", ROWS[:3]),
        ("by_split", "train", ROWS[:6]),
        ("by_split", "test", ROWS[6:]),
    ],
)
def test_every_local_format_loads_its_rows(saved, kind, split, expected):
    source = DatasetSource(str(saved[kind]), split=split, prompt="q", answer="a")
    assert {(p, a) for p, a, _ in source.load()} == pairs(expected)  # numbers in the answer column come as text
    solved = DatasetSource(str(saved[kind]), split=split, prompt="q", answer="a", solution="note")
    assert {s for _, _, s in solved.load()} == {"x"} and {s for _, _, s in source.load()} == {None}


def test_problems_are_a_pure_function_of_seed_and_step_and_cover_each_epoch(saved):
    task = DatasetTask({"path": str(saved["jsonl"]), "prompt": "q", "answer": "a"}, system_prompt="Be brief.")
    again = DatasetTask({"path": str(saved["jsonl"]), "prompt": "q", "answer": "a"}, system_prompt="Be brief.")
    assert task.problems(0, 3, 4) == again.problems(0, 3, 4)
    assert task.problems(0, 3, 4) != task.problems(1, 3, 4) and task.problems(0, 3, 4) != task.problems(0, 4, 4)
    epoch = [p for step in range(5) for p in task.problems(7, step, 2)]  # 10 rows: steps 0-4 are one epoch
    assert {(p.prompt, p.answer) for p in epoch} == pairs(ROWS) and len(epoch) == 10
    assert all(p.system_prompt == "Be brief." for p in epoch)
    assert task.reward(Problem("q", "3"), " 3\n") == 1.0 and task.reward(Problem("q", "3"), "4") == 0.0


def test_evaluation_draws_from_the_eval_split(saved):
    task = DatasetTask(
        {"path": str(saved["by_split"]), "split": "train", "prompt": "q", "answer": "a"}, {"split": "test"}
    )
    assert {(p.prompt, p.answer) for p in task.problems(0, -1, 4)} == pairs(ROWS[6:])
    assert {(p.prompt, p.answer) for p in task.problems(0, 0, 6)} == pairs(ROWS[:6])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"dataset": {"path": "nope.jsonl"}}, "no data set at nope.jsonl"),
        (
            {"dataset": {"path": "@jsonl", "prompt": "question"}},
            "no column 'question' for the prompt; its columns are q, a, note",
        ),
        ({"dataset": {"path": "@saved", "prompt": "q", "answer": "answer"}}, "no column 'answer' for the answer"),
        (
            {"dataset": {"path": "@saved_dict", "prompt": "q", "answer": "a"}},
            "holds splits test, train; name one with split:",
        ),
        ({"dataset": {"path": "@saved_dict", "split": "dev"}}, "has no split 'dev'; its splits are test, train"),
        ({"dataset": {"path": "@by_split", "split": "dev"}}, "has no split 'dev'; its splits are test, train"),
        ({"dataset": {"path": "@jsonl", "split": "train"}}, "is one file, so it is one split"),
        ({"dataset": {"path": "@text"}}, "is neither JSON Lines (.jsonl, .json) nor parquet"),
        ({"dataset": {"path": "@jsonl", "column": "q"}}, "unknown key 'column'; keys are path, split, prompt, answer"),
        ({"dataset": {"prompt": "q"}}, "task.dataset needs a path"),
        (
            {"dataset": {"path": "@jsonl", "prompt": "q", "answer": "a"}, "eval_dataset": {"split": "test"}},
            "is one file",
        ),
        ({"dataset": {"path": "@jsonl", "prompt": "q", "answer": "a"}, "size": 3}, "does not take these parameters"),
    ],
)
def test_a_data_set_that_cannot_be_read_is_refused_when_the_task_is_built(saved, tmp_path, params, message):
    (tmp_path / "rows.txt").write_text("q,a\n")
    places = {f"@{key}": str(value) for key, value in saved.items()} | {"@text": str(tmp_path / "rows.txt")}
    params = {
        key: {k: places.get(v, v) for k, v in value.items()} if isinstance(value, dict) else value
        for key, value in params.items()
    }
    with pytest.raises(ValueError, match=re.escape(message)):
        build_task(TaskConfig("dataset", params))


def test_a_parquet_files_columns_and_a_malformed_file_are_refused_when_the_rows_load(saved, tmp_path):
    task = DatasetTask({"path": str(saved["parquet"]), "prompt": "question", "answer": "a"})  # not read yet
    with pytest.raises(DatasetError, match="has no column 'question' for the prompt; its columns are q, a, note"):
        task.problems(0, 0, 1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"q": "x", "a": 1}\n{"q": \n')
    with pytest.raises(DatasetError, match="cannot read .*broken.jsonl as json"):
        DatasetSource(str(broken), prompt="q", answer="a").load()


def test_a_bad_data_set_is_a_topology_error_naming_the_key(tmp_path):
    math_small = ROOT / "topologies" / "math_small.yaml"
    with pytest.raises(TopologyError, match=r"math_small.yaml: task: no data set at /nope/train.jsonl"):
        load_topology(math_small, ["task.dataset.path=/nope/train.jsonl"])
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(TopologyError, match="has no column 'question' for the prompt"):
        load_topology(math_small, [f"task.dataset.path={tmp_path / 'rows.jsonl'}"])


def test_a_missing_solution_column_is_a_topology_error_in_one_paragraph(tmp_path):
    math_small = ROOT / "topologies" / "math_small.yaml"
    assert load_topology(math_small, ["task.solution=solution"]).task.config.params["solution"] == "solution"
    with pytest.raises(TopologyError) as refused:
        load_topology(math_small, ["task.solution=steps"])
    message = str(refused.value)
    assert "\n" not in message and "math_small.yaml: task: " in message
    assert "has no column 'steps' for the solution; its columns are question, answer, solution, kind" in message
    assert message.endswith("Set task.solution: to one of them, or leave it out to hint and trace the answer alone")
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "Q?", "answer": "#### 1"}])  # the eval set's too
    with pytest.raises(TopologyError, match=r"gsm8k.jsonl has no column 'solution' for the solution"):
        load_topology(math_small, ["task.solution=solution", f"task.eval_dataset={gsm8k}"])
