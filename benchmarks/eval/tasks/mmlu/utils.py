"""The MMLU task's documents and prompts (lm-eval's MMLU format: a topic line, the question, the
four options, "Answer:", scored on " A" .. " D")."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "mmlu.jsonl"
LETTERS = "ABCD"
SHOTS = 5


def is_question(row: dict) -> bool:
    # The file holds two copies of a CSV header ("correct_answer": "answer"): not questions.
    return row["correct_answer"] in tuple(LETTERS)


def process_docs(dataset):
    return dataset.filter(is_question).map(
        lambda row: {"answer": LETTERS.index(row["correct_answer"])}
    )


def question_text(row: dict) -> str:
    options = "".join(f"\n{letter}. {row[f'answer_{letter.lower()}']}" for letter in LETTERS)
    return f"{row['question'].strip()}{options}\nAnswer:"


def header(topic: str) -> str:
    return f"The following are multiple choice questions (with answers) about {topic}.\n\n"


def zero_shot_text(row: dict) -> str:
    return header(row["topic"]) + question_text(row)


@functools.cache
def _by_topic() -> dict[str, list[dict]]:
    topics: dict[str, list[dict]] = {}
    with DATA.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if is_question(row):
                topics.setdefault(row["topic"], []).append(row)
    return topics


def shots(row: dict) -> list[dict]:
    """SHOTS other questions of the row's topic, the same for the same question on every run."""
    others = [r for r in _by_topic()[row["topic"]] if r["question"] != row["question"]]
    return random.Random(row["question"]).sample(others, SHOTS)


def five_shot_text(row: dict) -> str:
    solved = "".join(f"{question_text(s)} {s['correct_answer']}\n\n" for s in shots(row))
    return header(row["topic"]) + solved + question_text(row)
