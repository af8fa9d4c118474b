"""Requests under LoRA adapters equal transformers + PEFT token for token, alone and mixed in one
batch with other adapters and base-model requests; log-probs within 1e-4; prefix reuse keyed by
the adapter."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.loading.model_paths import resolve_model
from backend.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, teacher_forced
from tests.lora.peft_adapters import ALL_PROJECTIONS, save_peft_adapter
from tests.tiny_models import TINY_SHAPE, random_prompts, save_tiny_hf_model

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama, adapter `a` (rank 8, every projection) and adapter `b` (rank 4,
    rsLoRA, attention q/v and down only): (model dir, {name: (dir, reference model)})."""
    root = tmp_path_factory.mktemp("lora-tiny")
    base = save_tiny_hf_model(root / "base", "llama").eval()
    adapters = {
        "a": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
        "b": dict(
            r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    }
    models = {None: (None, base)}
    for seed, (name, config) in enumerate(adapters.items()):
        path = root / name
        models[name] = (path, save_peft_adapter(root / "base", path, seed, std=0.1, **config))
    return root / "base", models


def serve(model_dir, models, jobs, **config):
    """jobs: (prompt, lora_name) served in one generate call (queued together)."""
    modules = ",".join(f"{name}={path}" for name, (path, _) in models.items() if name)
    executor = Executor(
        EngineConfig(model_path=str(model_dir), device="cpu", lora_modules=modules, **config)
    )
    try:
        params = [
            SamplingParams(
                max_tokens=MAX_TOKENS, ignore_end_id=True, return_log_probs=True, lora_name=name
            )
            for _, name in jobs
        ]
        return executor.generate([p for p, _ in jobs], params, timeout=600), executor.stats()
    finally:
        executor.shutdown()


def check(models, jobs, results):
    """Each result is its model's greedy output (checked in one teacher-forced forward: the
    model's pick after each prefix is the engine's next token), log-probs within 1e-4."""
    for (prompt, name), result in zip(jobs, results):
        assert result["error"] is None
        assert len(result["token_ids"]) == MAX_TOKENS
        picks, logprobs = teacher_forced(models[name][1], prompt, result["token_ids"])
        assert picks[:MAX_TOKENS] == result["token_ids"], name
        assert result["logprobs"] == pytest.approx(logprobs, rel=1e-4, abs=1e-4)


def assert_adapters_change_outputs(models, jobs, results):
    """Under each adapter some output differs from the base model's greedy picks (else matching
    PEFT would prove nothing)."""
    changed = set()
    for (prompt, name), result in zip(jobs, results):
        if name is not None:
            picks, _ = teacher_forced(models[None][1], prompt, result["token_ids"])
            if picks[:MAX_TOKENS] != result["token_ids"]:
                changed.add(name)
    assert changed == set(models) - {None}


def test_adapters_and_base_mixed_in_one_batch_match_peft(tiny):
    model_dir, models = tiny
    prompts = random_prompts(9, TINY_SHAPE["vocab_size"], seed=3, low=5, high=30)
    jobs = [(p, [None, "a", "b"][i % 3]) for i, p in enumerate(prompts)]
    results, stats = serve(model_dir, models, jobs, tokens_per_block=8, max_num_tokens=512)
    check(models, jobs, results)
    # served together: one prompt step, then one decode step per further token
    assert stats.num_iterations == MAX_TOKENS
    assert_adapters_change_outputs(models, jobs, results)


def test_each_adapter_alone_and_with_chunked_prefill(tiny):
    model_dir, models = tiny
    prompts = random_prompts(2, TINY_SHAPE["vocab_size"], seed=5, low=40, high=60)
    for name in ("a", "b"):
        jobs = [(p, name) for p in prompts]
        results, _ = serve(model_dir, models, jobs, tokens_per_block=8, max_num_tokens=16)
        check(models, jobs, results)


def test_mixed_with_overlap_scheduling_and_preemption(tiny):
    """Step n+1 packed while step n runs (overlap forced on), and a pool small enough that
    max_utilization preempts: requests recomputed under their own adapters."""
    model_dir, models = tiny
    prompts = random_prompts(9, TINY_SHAPE["vocab_size"], seed=17, low=20, high=40)
    jobs = [(p, [None, "a", "b"][i % 3]) for i, p in enumerate(prompts)]
    results, stats = serve(
        model_dir,
        models,
        jobs,
        tokens_per_block=8,
        overlap_scheduling=True,
        max_tokens_in_paged_kv_cache=160,
        batch_scheduler_policy="max_utilization",
    )
    check(models, jobs, results)
    assert stats.num_preemptions > 0


def test_fused_checkpoint_projections_and_rank_pattern(tmp_path):
    """Phi-3 stores q|k|v and gate|up as one tensor each: PEFT adapts them as whole modules;
    rank_pattern gives o_proj its own rank (and so its own scaling)."""
    base = save_tiny_hf_model(tmp_path / "base", "phi3").eval()
    config = dict(
        r=8,
        lora_alpha=16,
        rank_pattern={"o_proj": 4},
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    )
    adapted = save_peft_adapter(tmp_path / "base", tmp_path / "fused", 0, std=0.1, **config)
    models = {None: (None, base), "fused": (tmp_path / "fused", adapted)}
    prompts = random_prompts(4, TINY_SHAPE["vocab_size"], seed=13, low=5, high=30)
    jobs = [(p, [None, "fused"][i % 2]) for i, p in enumerate(prompts)]
    results, _ = serve(tmp_path / "base", models, jobs, tokens_per_block=8)
    check(models, jobs, results)
    assert_adapters_change_outputs(models, jobs, results)


def test_prefix_reuse_is_keyed_by_the_adapter(tiny):
    """The same prompt under the base, then `a`, then `b`, then `a` again (one engine): each
    equals its own reference, so no request read KV blocks computed under another adapter; the
    last one reuses `a`'s blocks."""
    model_dir, models = tiny
    prompt = random_prompts(1, TINY_SHAPE["vocab_size"], seed=11, low=40, high=41)[0]
    modules = ",".join(f"{name}={path}" for name, (path, _) in models.items() if name)
    executor = Executor(
        EngineConfig(
            model_path=str(model_dir), device="cpu", lora_modules=modules, tokens_per_block=8
        )
    )
    try:
        reused = []
        for name in (None, "a", "b", "a"):
            params = SamplingParams(max_tokens=MAX_TOKENS, ignore_end_id=True, lora_name=name)
            before = executor.stats().kv.reused_blocks
            result = executor.generate([prompt], params, timeout=600)[0]
            assert result["token_ids"] == hf_greedy(models[name][1], prompt, MAX_TOKENS)[0], name
            reused.append(executor.stats().kv.reused_blocks - before)
        assert reused[:3] == [0, 0, 0] and reused[3] == len(prompt) // 8
    finally:
        executor.shutdown()


# ---- the default model: SmolLM2-135M-Instruct -------------------------------------------------


@pytest.mark.slow
def test_default_model_adapters_mixed_with_base_match_peft(tmp_path):
    model_dir = resolve_model("default")
    models = {None: (None, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))}
    models[None][1].eval()
    configs = {
        "chat16": dict(r=16, lora_alpha=32, target_modules=ALL_PROJECTIONS),
        "attn8": dict(
            r=8,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
    }
    for seed, (name, config) in enumerate(configs.items()):
        path = tmp_path / name
        models[name] = (path, save_peft_adapter(model_dir, path, seed, std=0.02, **config))
    prompts = random_prompts(6, 49152, seed=2, low=8, high=24)
    jobs = [(p, [None, "chat16", "attn8"][i % 3]) for i, p in enumerate(prompts)]
    results, stats = serve(model_dir, models, jobs)
    check(models, jobs, results)
    assert stats.num_iterations == MAX_TOKENS
    assert_adapters_change_outputs(models, jobs, results)
