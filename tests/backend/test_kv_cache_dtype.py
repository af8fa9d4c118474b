"""`kv_cache_dtype` fp8 / int8 in the engine on CPU (float32 model, torch attention): the default
model's greedy output stays close to auto's, blocks go back to the pool, a quantized cache holds
more blocks in the same memory, and a bad value is refused by name."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig
from backend.engine.executor import Executor
from backend.runner import kv_cache_memory
from backend.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colours:",
    "The quick brown fox",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 16


def test_a_bad_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'int8'\)"
    ):
        EngineConfig(kv_cache_dtype="fp16")


def run_default_model(kv_cache_dtype: str, teacher: list[list[int]] | None, prompts) -> dict:
    """Greedy continuations of the prompts, then the log-probs of `teacher` sequences (auto's
    prompts + continuations) read as prompts; the pool's blocks after both."""
    config = EngineConfig(
        model_path="default",
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
        max_batch_size=8,
        max_seq_len=128,
    )
    executor = Executor(config)
    try:
        greedy = executor.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), timeout=None)
        outputs = [r["token_ids"] for r in greedy]
        teacher = teacher or [p + o for p, o in zip(prompts, outputs)]
        params = SamplingParams(max_tokens=1, return_prompt_log_probs=True)
        forced = executor.generate(teacher, params, timeout=None)
        return {
            "outputs": outputs,
            "teacher": teacher,
            "logprobs": [r["prompt_logprobs"] for r in forced],
            "kv": executor.stats().kv,
            "cache_dtype": executor.runner.kv_cache.dtype,
        }
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def default_model_runs(smollm2):
    prompts = [smollm2.encode(p) for p in PROMPTS]
    auto = run_default_model("auto", None, prompts)
    runs = {"auto": auto}
    for name in ("fp8", "int8"):
        runs[name] = run_default_model(name, auto["teacher"], prompts)
    return runs


def agreeing_tokens(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens before each continuation's first difference, summed."""
    return sum(
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(outputs, reference)
    )


@pytest.mark.parametrize(
    "name,least_agreeing,most_logprob_change",
    # Measured on this prompt set: fp8 56 of 92 tokens and 0.058 nats, int8 90 and 0.023.
    [("fp8", 0.4, 0.1), ("int8", 0.8, 0.05)],
)
def test_default_model_greedy_output_stays_close_to_auto(
    default_model_runs, name, least_agreeing, most_logprob_change
):
    """Greedy tokens agree with auto's up to a first difference (a near tie flips, and the texts
    part ways); read back as prompts, auto's continuations score within a few hundredths of a nat
    per token of what auto gives them. Every block is back in the pool after."""
    import torch

    auto, run = default_model_runs["auto"], default_model_runs[name]
    assert run["cache_dtype"] == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[name]
    total = sum(map(len, auto["outputs"]))
    agreeing = agreeing_tokens(run["outputs"], auto["outputs"])
    print(f"{name}: {agreeing} of {total} greedy tokens agree with auto")
    assert agreeing >= least_agreeing * total
    changes = [
        abs(a - b)
        for got, want in zip(run["logprobs"], auto["logprobs"])
        for a, b in zip(got, want)
        if a is not None and b is not None
    ]
    mean_change = sum(changes) / len(changes)
    print(f"{name}: mean |log-prob change| {mean_change:.4f} nats over {len(changes)} tokens")
    assert 0 < mean_change < most_logprob_change
    assert run["kv"].free_blocks == run["kv"].max_blocks == auto["kv"].max_blocks


def test_a_quantized_cache_holds_more_blocks_in_the_same_memory(tiny_hf_model, monkeypatch):
    """On CPU the pool is what fits a byte budget (`CPU_KV_CACHE_CAP_BYTES`, lowered here so that
    it binds). With head_dim 64, one token's key of one kv head takes 64 x 4 bytes in float32 (the
    CPU model dtype), 64 x 2 in bfloat16, and 64 + 2 (its bfloat16 scale) in fp8 or int8: 3.9x
    float32's blocks and 1.94x bfloat16's. The metric's `max` (the pool's size, through the
    executor's stats) follows, and the tensors allocated fit the budget."""
    budget = 1 << 20
    monkeypatch.setattr(kv_cache_memory, "CPU_KV_CACHE_CAP_BYTES", budget)
    _, path = tiny_hf_model("llama", hidden_size=128, head_dim=64, num_attention_heads=2)
    blocks = {}
    for dtype, kv_cache_dtype in [
        ("float32", "auto"),
        ("bfloat16", "auto"),
        ("float32", "fp8"),
        ("float32", "int8"),
    ]:
        config = EngineConfig(
            model_path=str(path),
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            tokens_per_block=16,
            max_batch_size=64,
            max_seq_len=1024,
        )
        executor = Executor(config)
        try:
            runner = executor.runner
            allocated = runner.kv_cache.numel() * runner.kv_cache.element_size()
            if runner.kv_scales is not None:
                allocated += runner.kv_scales.numel() * runner.kv_scales.element_size()
            assert allocated == runner.num_kv_blocks * runner.kv_block_bytes() <= budget
            assert executor.stats().kv.max_blocks == runner.num_kv_blocks
            blocks[dtype, kv_cache_dtype] = runner.num_kv_blocks
        finally:
            executor.shutdown()
    fp8 = blocks["float32", "fp8"]
    assert blocks["float32", "int8"] == fp8
    assert fp8 == budget // (2 * 2 * 16 * 2 * (64 + 2))  # layers, K|V, tokens, kv heads
    assert fp8 / blocks["float32", "auto"] > 3.8
    assert fp8 / blocks["bfloat16", "auto"] >= 1.9
