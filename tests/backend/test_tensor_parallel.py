"""Tensor parallelism on CPU (gloo, spawned worker ranks): the prefill logits of TP=2 and TP=3
equal one rank's within 1e-5 relative (only the all-reduce's summation order differs), and
64 greedy tokens, seeded samples and prompt log-probs equal one rank's; a worker's death fails
the requests in flight with an error naming the rank and stops the engine, without a hang."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from backend.attention import get_attention_backend
from backend.config import EngineConfig
from backend.distributed.tensor_parallel import TensorParallel
from backend.engine.executor import Executor
from backend.loading.model_loader import build_model
from backend.loading.model_paths import resolve_model
from backend.model_config import ModelConfig
from backend.models import FAMILIES
from backend.models.llama import LlamaForCausalLM
from backend.process.client import EngineProcess
from backend.request import Chunk, FinishReason
from backend.runner.model_runner import ModelRunner
from backend.sampling_params import SamplingParams
from tests.tiny_models import FAMILY_KINDS, random_prompts, save_tiny_hf_model
from tests.waiting import wait_until


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One thread per rank (the spawned workers read OMP_NUM_THREADS), so ranks do not fight
    over this machine's cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prefill_logits(model_dir, tp: int, prompts, **config) -> torch.Tensor:
    runner = ModelRunner(
        EngineConfig(
            model_path=str(model_dir),
            device="cpu",
            tensor_parallel_size=tp,
            tokens_per_block=8,
            max_tokens_in_paged_kv_cache=2048,
            **config,
        )
    )
    try:
        chunks, next_block = [], 0
        for prompt in prompts:
            blocks = -(-len(prompt) // 8)
            chunks.append(Chunk.of_sequence(prompt, list(range(next_block, next_block + blocks))))
            next_block += blocks
        return runner.execute(chunks).logits.clone()
    finally:
        runner.release()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    relative = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert relative <= 1e-5, relative


TINY_CASES = {
    # an odd vocabulary: the last rank's vocabulary shard is padded
    "llama": dict(model_type="llama", vocab_size=643),
    "qwen2-bias": dict(model_type="qwen2", tie_word_embeddings=True),
    "llama-attention-bias": dict(model_type="llama", attention_bias=True),
    # one KV head, two ranks: each keeps a copy of it
    "llama-mqa": dict(model_type="llama", num_key_value_heads=1),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_prefill_logits_of_two_ranks_equal_one(case, tmp_path):
    save_tiny_hf_model(tmp_path, **TINY_CASES[case])
    prompts = random_prompts(4, 640, seed=3, low=5, high=60)
    assert_close(prefill_logits(tmp_path, 2, prompts), prefill_logits(tmp_path, 1, prompts))


def test_a_quantized_kv_cache_on_two_ranks_equals_one(tmp_path):
    """Each rank quantizes its own KV heads into its own pool (one KV head: both keep a copy)."""
    save_tiny_hf_model(tmp_path, **TINY_CASES["llama-mqa"])
    prompts = random_prompts(3, 640, seed=7, low=5, high=60)
    options = dict(kv_cache_dtype="fp8")
    one = prefill_logits(tmp_path, 1, prompts, **options)
    assert not torch.allclose(one, prefill_logits(tmp_path, 1, prompts), rtol=1e-4)
    assert_close(prefill_logits(tmp_path, 2, prompts, **options), one)


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_families_on_two_ranks_equal_one(kind, tmp_path):
    """Qwen3 (QK-norm per head), Phi-3 (fused q|k|v and gate|up checkpoint tensors, cut per
    part), Gemma 1/2/3 (one KV head replicated, (1 + w) norms, soft-capping, local rotary)."""
    save_tiny_hf_model(tmp_path, model_type=kind)
    prompts = random_prompts(3, 640, seed=4, low=5, high=60)
    assert_close(prefill_logits(tmp_path, 2, prompts), prefill_logits(tmp_path, 1, prompts))


@pytest.mark.parametrize(
    "kind, windows", [("mistral", "16"), ("gemma2", "16,1024"), ("gemma3_text", "24")]
)
def test_windows_and_sinks_on_two_ranks_equal_one(kind, windows, tmp_path):
    """Prompts longer than the window, with sinks: each rank's heads see the same keys."""
    save_tiny_hf_model(tmp_path, model_type=kind)
    prompts = random_prompts(3, 640, seed=6, low=40, high=90)
    options = dict(max_attention_window_size=windows, sink_token_length=4)
    full = prefill_logits(tmp_path, 1, prompts)
    one = prefill_logits(tmp_path, 1, prompts, **options)
    assert not torch.allclose(one, full, rtol=1e-3)  # the window changes the result
    assert_close(prefill_logits(tmp_path, 2, prompts, **options), one)


def serve(model_dir, tp: int, prompts, params, **config) -> list[dict]:
    executor = Executor(
        EngineConfig(
            model_path=str(model_dir),
            device="cpu",
            tensor_parallel_size=tp,
            tokens_per_block=8,
            max_num_tokens=128,  # prompts prefill in chunks
            max_tokens_in_paged_kv_cache=4096,
            **config,
        )
    )
    try:
        return executor.generate(prompts, params, timeout=600)
    finally:
        executor.shutdown()


def test_tokens_of_two_ranks_equal_one(tmp_path):
    """64 greedy tokens, seeded samples and prompt log-probs, batched, with chunked prefill and
    overlap scheduling (the in-flight ids travel from rank 0 to the worker)."""
    save_tiny_hf_model(tmp_path, model_type="qwen2")
    prompts = random_prompts(6, 640, seed=5, low=10, high=150)
    params = [SamplingParams(max_tokens=64, ignore_end_id=True, return_log_probs=True)] * 3
    params += [
        SamplingParams(max_tokens=64, ignore_end_id=True, temperature=0.9, top_k=50, seed=11),
        SamplingParams(max_tokens=64, ignore_end_id=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=8, ignore_end_id=True, return_prompt_log_probs=True),
    ]
    one = serve(tmp_path, 1, prompts, params)
    two = serve(tmp_path, 2, prompts, params, overlap_scheduling=True)
    for a, b in zip(one, two):
        assert b["error"] is None
        assert b["token_ids"] == a["token_ids"]
        assert b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-5)
    assert len(two[0]["token_ids"]) == 64
    assert two[5]["prompt_logprobs"] == pytest.approx(one[5]["prompt_logprobs"], abs=1e-5)


def test_local_and_global_kv_cache_groups_on_two_ranks_equal_one(tmp_path):
    """Gemma 3 with five local layers (window 16) and one global: two KV cache groups, each
    group's slots and block tables sent to the worker, whose pools free the local blocks too."""
    save_tiny_hf_model(tmp_path, model_type="gemma3_text", sliding_window=16)
    prompts = random_prompts(3, 640, seed=7, low=40, high=90)
    params = SamplingParams(max_tokens=12, ignore_end_id=True, return_log_probs=True)
    one = serve(tmp_path, 1, prompts, params)
    two = serve(tmp_path, 2, prompts, params, overlap_scheduling=True)
    for a, b in zip(one, two):
        assert b["error"] is None and b["token_ids"] == a["token_ids"]
        assert b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-5)


def test_default_model_on_three_ranks_equals_one():
    """SmolLM2-135M: 9 heads on 3 KV heads, so 3 heads and 1 KV head per rank."""
    model_dir = resolve_model("default", "none")
    prompts = random_prompts(3, 49152, seed=2, low=20, high=80)
    assert_close(prefill_logits(model_dir, 3, prompts), prefill_logits(model_dir, 1, prompts))
    params = SamplingParams(max_tokens=64, ignore_end_id=True)
    one = serve(model_dir, 1, prompts[:2], params)
    three = serve(model_dir, 3, prompts[:2], params)
    assert [r["token_ids"] for r in three] == [r["token_ids"] for r in one]
    assert all(len(r["token_ids"]) == 64 for r in three)


def test_shapes_that_do_not_split_are_refused(tmp_path):
    save_tiny_hf_model(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide .*attention heads"):
        ModelRunner(EngineConfig(model_path=str(tmp_path), device="cpu", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="gpu_device_ids must list one GPU index per rank"):
        EngineConfig(tensor_parallel_size=2, gpu_device_ids="0")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_gguf_kept_quantized_is_refused():
    with pytest.raises(
        ValueError, match="quantization 'gguf' is not supported with tensor_parallel_size > 1"
    ):
        ModelRunner(EngineConfig(device="cpu", quantization="gguf", tensor_parallel_size=3))


def test_a_family_that_does_not_split_is_refused_by_name(tmp_path, monkeypatch):
    class Unsplit(LlamaForCausalLM):
        supports_tensor_parallel = False

    save_tiny_hf_model(tmp_path, model_type="phi3")
    monkeypatch.setitem(FAMILIES, "phi3", Unsplit)
    config = ModelConfig.from_dir(str(tmp_path))
    attention = get_attention_backend("torch")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported for .*'phi3'"):
        build_model(
            config, torch.device("cpu"), torch.float32, attention, 64, tp=TensorParallel(0, 2)
        )


@pytest.mark.parametrize("quantization", ["int8_wo", "fp8"])
def test_quantized_weights_are_refused(quantization, tmp_path):
    save_tiny_hf_model(tmp_path)
    config = EngineConfig(
        model_path=str(tmp_path), device="cpu", quantization=quantization, tensor_parallel_size=2
    )
    with pytest.raises(
        ValueError,
        match=f"quantization '{quantization}' is not supported with tensor_parallel_size > 1",
    ):
        ModelRunner(config)


def _start_a_long_request(engine):
    """Submit a long request to `engine` (an Executor or EngineProcess) and wait for its first
    output: (finished event, outputs, the callback, the sampling params)."""
    done, outputs = threading.Event(), []

    def on_output(out):
        outputs.append(out)
        if out.finished:
            done.set()

    params = SamplingParams(max_tokens=900, ignore_end_id=True)
    engine.submit("long", [5, 6, 7], params, on_output)
    wait_until(lambda: outputs, "the long request's first output", timeout_s=120)
    return done, outputs, on_output, params


def test_a_dead_worker_fails_requests_and_stops_the_executor(tmp_path):
    save_tiny_hf_model(tmp_path)
    executor = Executor(
        EngineConfig(model_path=str(tmp_path), device="cpu", tensor_parallel_size=2)
    )
    try:
        done, outputs, on_output, params = _start_a_long_request(executor)
        worker = executor.runner.workers.processes[0]
        os.kill(worker.pid, 9)
        assert done.wait(30), "the request hangs"
        last = outputs[-1]
        assert last.finish_reason == FinishReason.ERROR
        assert f"tensor-parallel rank 1 (pid {worker.pid}) died" in last.error
        assert not executor.ready
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            executor.submit("later", [5], params, on_output)
    finally:
        executor.shutdown()


def test_engine_process_reports_a_dead_worker(tmp_path):
    """Through the engine's own process: the request in flight fails naming the rank, the
    handle is no longer alive and the process exits."""
    save_tiny_hf_model(tmp_path)
    engine = EngineProcess(
        EngineConfig(model_path=str(tmp_path), device="cpu", tensor_parallel_size=2)
    )
    try:
        done, outputs, on_output, params = _start_a_long_request(engine)
        pid = engine.info.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        workers = [c for c in children if "tp-rank" in _cmdline(c) or _is_worker(c)]
        assert len(workers) == 1, children
        os.kill(int(workers[0]), 9)
        assert done.wait(30), "the request hangs"
        assert outputs[-1].finish_reason == FinishReason.ERROR
        assert "tensor-parallel rank 1" in outputs[-1].error
        assert engine.process.wait(30) != 0
        assert not engine.alive
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            engine.submit("later", [5], params, on_output)
    finally:
        engine.shutdown()


def _cmdline(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _is_worker(pid: str) -> bool:
    """A spawned rank, not multiprocessing's resource tracker."""
    cmdline = _cmdline(pid)
    return "spawn_main" in cmdline and "resource_tracker" not in cmdline
