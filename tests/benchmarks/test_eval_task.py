"""benchmarks/eval: the task's data is well formed, and run.py's comparison reports every
log-likelihood apart by the tolerance and every changed answer (lm-eval itself is the `eval`
extra; tests/e2e/test_eval.py runs it)."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks.eval.run import (
    DEFAULT_TASK,
    TASKS_DIR,
    TaskRun,
    agreement,
    compare,
    lm_eval_task,
    shortest_per_topic,
)

TASK_DIR = TASKS_DIR / DEFAULT_TASK


def test_the_task_reads_its_questions_from_the_repository():
    task = yaml.safe_load((TASK_DIR / f"{DEFAULT_TASK}.yaml").read_text())
    assert task["task"] == DEFAULT_TASK and task["dataset_path"] == "json"
    data = task["dataset_kwargs"]["data_files"][task["test_split"]]
    assert (TASKS_DIR.parents[2] / data).resolve() == TASK_DIR / "questions.jsonl"
    rows = [json.loads(line) for line in (TASK_DIR / "questions.jsonl").read_text().splitlines()]
    assert 40 <= len(rows) <= 60
    assert len({r["question"] for r in rows}) == len(rows)
    for row in rows:
        assert set(row) == {"question", "choices", "answer"}
        assert len(row["choices"]) == len(set(row["choices"])) == 4
        assert row["answer"] in range(4)
    assert {r["answer"] for r in rows} == {0, 1, 2, 3}  # no position always right


def test_compare_reports_log_likelihoods_apart_and_changed_answers():
    reference = TaskRun(0.5, {0: [-1.0, -2.0], 1: [-3.0, -0.5]})
    assert compare(TaskRun(0.5, {0: [-1.0004, -2.0], 1: [-3.0, -0.5]}), reference, 1e-3) == []
    apart = compare(TaskRun(0.5, {0: [-1.002, -2.0], 1: [-3.0, -0.5]}), reference, 1e-3)
    assert apart == ["question 0 choice 0: served -1.002000, hf -1.000000"]
    flipped = compare(TaskRun(0.0, {0: [-2.5, -2.0], 1: [-3.0, -0.5]}), reference, 1e-3)
    assert "question 0: served chose 1, hf chose 0" in flipped
    assert compare(TaskRun(0.5, {0: [-1.0, -2.0]}), reference, 1e-3) == [
        "the runs scored different questions"
    ]


def test_mmlu_file_holds_the_14042_test_questions_in_57_topics():
    from benchmarks.eval.mmlu_data import mmlu_file
    from benchmarks.eval.tasks.mmlu import utils

    rows = [json.loads(line) for line in mmlu_file().read_text().splitlines()]
    questions = [r for r in rows if utils.is_question(r)]
    assert len(rows) == 14_044 and len(questions) == 14_042  # less the two CSV header lines
    assert len({r["topic"] for r in questions}) == 57
    assert {r["correct_answer"] for r in questions} == set("ABCD")


def test_mmlu_five_shots_come_from_the_topic_without_the_question():
    from benchmarks.eval.mmlu_data import mmlu_file
    from benchmarks.eval.tasks.mmlu import utils

    mmlu_file()
    for row in (utils._by_topic()["astronomy"][3], utils._by_topic()["virology"][0]):
        shots = utils.shots(row)
        assert len(shots) == 5 and shots == utils.shots(dict(row))  # the same on every run
        assert all(s["topic"] == row["topic"] and s["question"] != row["question"] for s in shots)
        text = utils.five_shot_text(row)
        assert text.startswith(utils.header(row["topic"]))
        assert text.endswith(utils.zero_shot_text(row).removeprefix(utils.header(row["topic"])))
        assert text.count("\nAnswer:") == 6 and text.count(row["question"].strip()) == 1


def test_task_and_shots_are_checked_by_name():
    with pytest.raises(ValueError, match="task must be one of tritonllm_mc, mmlu, got 'mmlu2'"):
        lm_eval_task("mmlu2", 0)
    with pytest.raises(ValueError, match=r"shots for task mmlu must be one of \[0, 5\], got 3"):
        lm_eval_task("mmlu", 3)
    assert lm_eval_task("mmlu", 5) == "tritonllm_mmlu_5shot"


def test_accuracy_per_topic_and_agreement():
    def run(scores):
        return TaskRun(0.0, dict(enumerate(scores)), {0: 0, 1: 1, 2: 0}, {0: "a", 1: "a", 2: "b"})

    served = run([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0]])
    assert served.accuracy_per_topic() == {"a": 0.5, "b": 1.0}
    assert agreement(served, run([[-1.0, -2.0], [-2.0, -1.0], [-1.0, -2.0]])) == 2 / 3


def test_shortest_per_topic_takes_each_topics_shortest_in_turn():
    lengths = [5, 1, 9, 3, 2, 7]
    topics = ["a", "a", "a", "b", "b", "c"]
    assert shortest_per_topic(lengths, topics, 3) == [1, 4, 5]  # a's, b's, c's shortest
    assert shortest_per_topic(lengths, topics, 5) == [0, 1, 3, 4, 5]  # then a's and b's second
