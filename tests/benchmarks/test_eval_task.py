"""benchmarks/eval: the task's data is well formed, and run.py's comparison reports every
log-likelihood apart by the tolerance and every changed answer (lm-eval itself is the `eval`
extra; tests/e2e/test_eval.py runs it)."""

from __future__ import annotations

import json

import yaml

from benchmarks.eval.run import DEFAULT_TASK, TASKS_DIR, TaskRun, compare

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
