"""The shipped GSM8K-style data set: short arithmetic word problems, generated deterministically.

GSM8K's problems take a 7B model; a random-init model on a CPU needs the same form (a word
problem, a numeric answer, a worked solution ending ``#### <answer>``) at a size it can
learn in minutes: one or two operations on numbers up to 20. Each row has ``question``,
``answer`` (the number alone), ``solution`` (GSM8K's answer format) and ``kind``.

Regenerate the files (byte-identical; a test holds them so) with::

    python -m actors.tasks.arithmetic_data
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data" / "arithmetic"
SIZES = {"train": 4000, "test": 400}
NAMES = ["Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kim", "Leo", "Mia", "Noor", "Omar"]
ITEMS = ["apples", "books", "cards", "coins", "eggs", "pens", "shells", "stamps", "stickers", "toys"]

Row = dict[str, str]


def _add(rng: random.Random, name: str, other: str, items: str) -> tuple[str, int, str]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return (
        f"{name} has {a} {items}. {other} gives {name} {b} more. How many {items} does {name} have now?",
        a + b,
        f"{a} + {b} = {a + b}",
    )


def _subtract(rng: random.Random, name: str, other: str, items: str) -> tuple[str, int, str]:
    b = rng.randint(1, 20)
    a = b + rng.randint(0, 20)
    return (
        f"{name} had {a} {items} and gave {b} to {other}. How many {items} does {name} have left?",
        a - b,
        f"{a} - {b} = {a - b}",
    )


def _multiply(rng: random.Random, name: str, other: str, items: str) -> tuple[str, int, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"{name} has {a} bags with {b} {items} in each. How many {items} does {name} have?",
        a * b,
        f"{a} * {b} = {a * b}",
    )


def _divide(rng: random.Random, name: str, other: str, items: str) -> tuple[str, int, str]:
    b, share = rng.randint(2, 9), rng.randint(1, 9)
    a = b * share
    question = f"{name} shares {a} {items} equally among {b} friends. How many {items} does each friend get?"
    return question, share, f"{a} / {b} = {share}"


def _money(rng: random.Random, name: str, other: str, items: str) -> tuple[str, int, str]:
    a, price = rng.randint(2, 9), rng.randint(1, 12)
    question = f"{name} buys {a} {items} at ${price} each. How many dollars does {name} spend?"
    return question, a * price, f"{a} * {price} = {a * price}"


def _two_steps(rng: random.Random, name: str, other: str, items: str) -> tuple[str, int, str]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    c = rng.randint(1, a + b)
    question = (
        f"{name} has {a} {items} and finds {b} more, then gives {c} to {other}. How many {items} does {name} have now?"
    )
    return question, a + b - c, f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}"


KINDS: dict[str, Callable[[random.Random, str, str, str], tuple[str, int, str]]] = {
    "add": _add,
    "subtract": _subtract,
    "multiply": _multiply,
    "divide": _divide,
    "money": _money,
    "two_steps": _two_steps,
}


def generate(split: str, count: int) -> list[Row]:
    """``count`` distinct rows of ``split``, a function of the split's name alone; a test question
    never appears in train (a repeat is drawn again)."""
    rng = random.Random(f"arithmetic/{split}")
    seen = {row["question"] for row in generate("test", SIZES["test"])} if split == "train" else set()
    rows: list[Row] = []
    while len(rows) < count:
        kind = rng.choice(sorted(KINDS))
        name, other = rng.sample(NAMES, 2)
        question, answer, work = KINDS[kind](rng, name, other, rng.choice(ITEMS))
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": str(answer), "solution": f"{work}\n#### {answer}", "kind": kind})
    return rows


def write(directory: Path = DATA_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in SIZES.items():
        lines = [json.dumps(row) + "\n" for row in generate(split, count)]
        (directory / f"{split}.jsonl").write_text("".join(lines))


if __name__ == "__main__":
    write()
    print(f"wrote {', '.join(f'{split}.jsonl ({n} rows)' for split, n in SIZES.items())} to {DATA_DIR}")
