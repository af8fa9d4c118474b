"""The mixed-step profile on CPU with a tiny model: the steps it builds and what it reports."""

from __future__ import annotations

import json

from benchmarks.mixed_step import main
from tests.tiny_models import make_tiny_model


def test_mixed_step_profiles_each_kind_of_step(tmp_path):
    make_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "mixed.json"
    argv = ["--model", str(tmp_path / "model"), "--device", "cpu", "--batch", "4", "--isl", "20"]
    main([*argv, "--prompts", "1", "2", "--repeats", "2", "--top", "3", "--json", str(out)])
    steps = json.loads(out.read_text())["steps"]
    assert [(s["step"], s["tokens"]) for s in steps] == [
        ("4 decodes", 4),
        ("3 decodes + 1 prompt", 3 + 20),
        ("1 prompt", 20),
        ("2 decodes + 2 prompts", 2 + 40),
        ("2 prompts", 40),
    ]
    for s in steps:
        assert 0 < s["host_queue_ms"] and 0 < s["wall_ms"]
        assert len(s["top_host_ops"]) == 3 and s["top_host_ops"][0]["own_ms"] > 0
