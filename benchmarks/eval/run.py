"""Accuracy of a served model on a multiple-choice task, through the OpenAI completions endpoint.

  make serve                                  # another terminal: the server with --openai-port 9000
  python -m benchmarks.eval.run --base-url http://localhost:9000/v1/completions [--compare-hf]

lm-evaluation-harness's `local-completions` model scores each choice by the log-likelihood the
server returns for it (echo + logprobs). With --compare-hf the same task also runs in-process on
the Hugging Face checkpoint of the served model, and every choice's log-likelihood must agree
within --tolerance and every question must get the same answer: the served engine is scored,
not just its front end. Run from the repository root (the task's data path is relative to it).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_TASK = "tritonllm_mc"


@dataclass
class TaskRun:
    accuracy: float
    loglikelihoods: dict[int, list[float]]  # doc_id -> one log-likelihood per choice

    def chosen(self, doc_id: int) -> int:
        scores = self.loglikelihoods[doc_id]
        return scores.index(max(scores))


def evaluate(
    model: str, model_args: dict, task: str, limit: int | None = None, batch_size: int = 1
) -> TaskRun:
    """Run lm-eval in-process on one task and keep its per-choice log-likelihoods."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    output = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        log_samples=True,
        limit=limit,
        batch_size=batch_size,
    )
    samples = output["samples"][task]
    return TaskRun(
        accuracy=output["results"][task]["acc,none"],
        loglikelihoods={
            s["doc_id"]: [float(resp[0]) for resp in s["filtered_resps"]] for s in samples
        },
    )


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
    parser.add_argument("--task", default=DEFAULT_TASK)
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--compare-hf", action="store_true", help="also run hf in-process")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    from backend.loading.model_paths import resolve_model

    checkpoint = resolve_model(args.model)  # the HF directory the engine loads
    served = evaluate(
        "local-completions",
        served_args(
            args.base_url, args.served_name or served_model_name(args.base_url), checkpoint
        ),
        args.task,
        args.limit,
    )
    print(f"{args.task}: served accuracy {served.accuracy:.4f} ({len(served.loglikelihoods)} q)")
    result = {"task": args.task, "served_accuracy": served.accuracy}
    problems: list[str] = []
    if args.compare_hf:
        reference = evaluate(
            "hf",
            dict(pretrained=checkpoint, dtype="float32", device="cpu"),
            args.task,
            args.limit,
            batch_size=8,
        )
        problems = compare(served, reference, args.tolerance)
        print(f"{args.task}: hf accuracy {reference.accuracy:.4f}")
        result |= {"hf_accuracy": reference.accuracy, "disagreements": problems}
        for line in problems:
            print(line)
        print("served and hf agree" if not problems else f"{len(problems)} disagreements")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
