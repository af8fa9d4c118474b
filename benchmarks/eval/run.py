"""Accuracy of a served model on a multiple-choice task, through the OpenAI completions endpoint.

  make serve                                  # another terminal: the server with --openai-port 9000
  python -m benchmarks.eval.run --base-url http://localhost:9000/v1/completions [--compare-hf]

lm-evaluation-harness's `local-completions` model scores each choice by the log-likelihood the
server returns for it (echo + logprobs). With --compare-hf the same task also runs in-process on
the Hugging Face checkpoint of the served model, and every choice's log-likelihood must agree
within --tolerance and every question must get the same answer: the served engine is scored,
not just its front end. Run from the repository root (the task's data path is relative to it).

--task mmlu: MMLU's test set (tasks/mmlu/README.md; the data file is fetched once), 0-shot, or
with --shots 5 after 5 solved questions of the same topic; accuracy per topic is reported too.
--spread N scores N questions spread evenly over the task, --shortest N each topic's shortest
questions in turn (a quick check), --limit N the first N.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_TASK = "tritonllm_mc"
# --task name -> the lm-eval task for each --shots (lm-eval's own `mmlu` is another task)
TASKS = {
    "tritonllm_mc": {0: "tritonllm_mc"},
    "mmlu": {0: "tritonllm_mmlu", 5: "tritonllm_mmlu_5shot"},
}


@dataclass
class TaskRun:
    accuracy: float
    loglikelihoods: dict[int, list[float]]  # doc_id -> one log-likelihood per choice
    targets: dict[int, int] = field(default_factory=dict)  # doc_id -> the right choice
    topics: dict[int, str] = field(default_factory=dict)  # doc_id -> topic, where the task has

    def chosen(self, doc_id: int) -> int:
        scores = self.loglikelihoods[doc_id]
        return scores.index(max(scores))

    def accuracy_per_topic(self) -> dict[str, float]:
        right: dict[str, list[bool]] = {}
        for doc_id, topic in sorted(self.topics.items(), key=lambda item: item[1]):
            right.setdefault(topic, []).append(self.chosen(doc_id) == self.targets[doc_id])
        return {topic: sum(r) / len(r) for topic, r in right.items()}


def lm_eval_task(task: str, shots: int) -> str:
    """The lm-eval task for --task and --shots (ValueError naming what each task takes)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if shots not in TASKS[task]:
        raise ValueError(f"shots for task {task} must be one of {sorted(TASKS[task])}, got {shots}")
    if task == "mmlu":
        from benchmarks.eval.mmlu_data import mmlu_file

        mmlu_file()  # fetched once (with a progress bar), before lm-eval reads it
    return TASKS[task][shots]


@functools.cache
def task_manager():
    """lm-eval's index of its tasks and ours (built once: ~3 s of reading YAML files)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def subset(task: str, count: int, shortest: bool = False) -> dict[str, list[int]]:
    """`count` question ids of the task (lm-eval's `samples`): spread evenly over it, or with
    `shortest` each topic's shortest prompts in turn (every topic, at a fraction of the tokens)."""
    loaded = task_manager().load([task])["tasks"][task]
    docs = loaded.eval_docs
    if not 0 < count <= len(docs):
        raise ValueError(f"the subset of {task} must be in [1, {len(docs)}] questions, got {count}")
    if not shortest:
        return {task: sorted({i * len(docs) // count for i in range(count)})}
    lengths = [len(loaded.doc_to_text(doc)) for doc in docs]
    topics = [doc.get("topic", "") for doc in docs]
    return {task: shortest_per_topic(lengths, topics, count)}


def shortest_per_topic(lengths: list[int], topics: list[str], count: int) -> list[int]:
    """Ids of `count` prompts: each topic's shortest, then each one's second shortest, ..."""
    ranked: dict[str, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        ranked.setdefault(topics[i], []).append(i)
    columns = itertools.zip_longest(*(ranked[t] for t in sorted(ranked)))
    return sorted(itertools.islice((i for row in columns for i in row if i is not None), count))


def evaluate(
    model: str,
    model_args: dict,
    task: str,
    limit: int | None = None,
    batch_size: int = 1,
    samples: dict[str, list[int]] | None = None,
) -> TaskRun:
    """Run lm-eval in-process on one task and keep its per-choice log-likelihoods."""
    import lm_eval

    output = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=task_manager(),
        log_samples=True,
        limit=limit,
        samples=samples,
        batch_size=batch_size,
    )
    scored = output["samples"][task]
    return TaskRun(
        accuracy=output["results"][task]["acc,none"],
        loglikelihoods={
            s["doc_id"]: [float(resp[0]) for resp in s["filtered_resps"]] for s in scored
        },
        targets={s["doc_id"]: int(s["target"]) for s in scored},
        topics={s["doc_id"]: s["doc"]["topic"] for s in scored if "topic" in s["doc"]},
    )


def agreement(served: TaskRun, reference: TaskRun) -> float:
    """The share of questions both runs answer alike."""
    both = served.loglikelihoods.keys() & reference.loglikelihoods.keys()
    return sum(served.chosen(d) == reference.chosen(d) for d in both) / max(len(both), 1)


def served_args(base_url: str, served_model: str, tokenizer: str) -> dict:
    return dict(
        base_url=base_url,
        model=served_model,
        tokenizer=tokenizer,
        tokenizer_backend="huggingface",
        tokenized_requests=True,  # prompt: [[token ids]], echo + logprobs (lm-eval's protocol)
        num_concurrent=4,
        max_retries=1,
    )


def served_model_name(base_url: str) -> str:
    """The name the server lists at /v1/models (requests must name it)."""
    models_url = base_url.rsplit("/", 1)[0] + "/models"
    with urllib.request.urlopen(models_url, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def compare(served: TaskRun, reference: TaskRun, tolerance: float) -> list[str]:
    """Every disagreement between two runs of the same task, as readable lines."""
    problems = []
    if served.loglikelihoods.keys() != reference.loglikelihoods.keys():
        problems.append("the runs scored different questions")
    for doc_id in sorted(served.loglikelihoods.keys() & reference.loglikelihoods.keys()):
        ours, theirs = served.loglikelihoods[doc_id], reference.loglikelihoods[doc_id]
        for choice, (a, b) in enumerate(zip(ours, theirs)):
            if abs(a - b) >= tolerance:
                problems.append(f"question {doc_id} choice {choice}: served {a:.6f}, hf {b:.6f}")
        if served.chosen(doc_id) != reference.chosen(doc_id):
            problems.append(
                f"question {doc_id}: served chose {served.chosen(doc_id)}, "
                f"hf chose {reference.chosen(doc_id)}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.eval.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://localhost:9000/v1/completions")
    parser.add_argument("--model", default="default", help="the served model ('default', a path)")
    parser.add_argument(
        "--served-name", default=None, help="the model name to send (default: /v1/models' first)"
    )
    parser.add_argument("--task", default=DEFAULT_TASK, help=f"one of {', '.join(TASKS)}")
    parser.add_argument("--shots", type=int, default=0, help="solved examples first (mmlu: 0, 5)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--spread", type=int, default=None, help="N questions spread evenly")
    parser.add_argument(
        "--shortest", type=int, default=None, help="N questions, each topic's shortest in turn"
    )
    parser.add_argument("--compare-hf", action="store_true", help="also run hf in-process")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    subsets = [name for name in ("limit", "spread", "shortest") if getattr(args, name) is not None]
    if len(subsets) > 1:
        parser.error(f"{' and '.join(subsets)} exclude each other: give one")
    try:
        task = lm_eval_task(args.task, args.shots)
        samples = None
        if args.spread is not None or args.shortest is not None:
            samples = subset(task, args.spread or args.shortest, args.shortest is not None)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))

    from backend.loading.model_paths import resolve_model

    checkpoint = resolve_model(args.model)  # the HF directory the engine loads
    started = time.monotonic()
    served = evaluate(
        "local-completions",
        served_args(
            args.base_url, args.served_name or served_model_name(args.base_url), checkpoint
        ),
        task,
        args.limit,
        samples=samples,
    )
    served_s = time.monotonic() - started
    print(
        f"{task}: served accuracy {served.accuracy:.4f} "
        f"({len(served.loglikelihoods)} questions, {served_s:.1f} s)"
    )
    result = {
        "task": task,
        "model": args.model,
        "questions": len(served.loglikelihoods),
        "served_accuracy": served.accuracy,
        "served_seconds": round(served_s, 1),
    }
    if served.topics:
        result["served_accuracy_per_topic"] = served.accuracy_per_topic()
    problems: list[str] = []
    if args.compare_hf:
        started = time.monotonic()
        reference = evaluate(
            "hf",
            dict(pretrained=checkpoint, dtype="float32", device="cpu"),
            task,
            args.limit,
            batch_size=8,
            samples=samples,
        )
        problems = compare(served, reference, args.tolerance)
        print(f"{task}: hf accuracy {reference.accuracy:.4f}")
        result |= {
            "hf_accuracy": reference.accuracy,
            "hf_seconds": round(time.monotonic() - started, 1),
            "agreement": agreement(served, reference),
            "disagreements": problems,
        }
        if reference.topics:
            result["hf_accuracy_per_topic"] = reference.accuracy_per_topic()
            for topic, accuracy in result["served_accuracy_per_topic"].items():
                hf = result["hf_accuracy_per_topic"][topic]
                print(f"  {topic:<40} served {accuracy:.4f}  hf {hf:.4f}")
        for line in problems:
            print(line)
        print("served and hf agree" if not problems else f"{len(problems)} disagreements")
        print(f"the same answer to {result['agreement']:.2%} of the questions")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
