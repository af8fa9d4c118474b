"""`python -m tests.deploy.gotemplate` (docs/deployment.md's command for rendering the chart where
no helm is installed) prints the objects the chart's tests render, `--set` values included."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.deploy.gotemplate import Chart, main

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tritonllm"


def test_the_command_prints_the_rendered_objects(capsys):
    argv = [str(CHART), "--release", "llm", "--set", "engine.max_batch_size=128"]
    argv += ["--set", "model.volume.type=pvc", "--set", "model.volume.claimName=llm-models"]
    assert main(argv) == 0
    printed = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    values = {"engine": {"max_batch_size": 128}}
    values["model"] = {"volume": {"type": "pvc", "claimName": "llm-models"}}
    assert printed == Chart(CHART).manifests(values, release="llm")


def test_a_refused_value_exits_1_with_the_chart_message(capsys):
    assert main([str(CHART), "--set", "autoscaling.metric=gpu_util"]) == 1
    assert "autoscaling.metric must be waiting or kv_cache" in capsys.readouterr().err
