"""The LLM model's tensor conversions (no Triton needed): inputs -> engine requests, engine
outputs -> response tensors whose detokenization windows rebuild the exact text."""

from __future__ import annotations

import numpy as np
import pytest

from backend.request import FinishReason, RequestOutput
from ensemble.tensors import PERF_OUTPUTS, TENSORRT_LLM, TOP_LOGPROB_OUTPUTS
from tests.adapters import load_adapter

llm_inputs = load_adapter("tensorrt_llm", "llm_inputs")
llm_outputs = load_adapter("tensorrt_llm", "llm_outputs")
Defaults, convert_request, is_stop_request = (
    llm_inputs.Defaults,
    llm_inputs.convert_request,
    llm_inputs.is_stop_request,
)
RowStream, stack_rows = llm_outputs.RowStream, llm_outputs.stack_rows

VOCAB = 1000


def _request(**inputs) -> dict[str, np.ndarray]:
    """One batch row; scalars as [1, 1] tensors like tritonclient sends them."""
    tensors = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32)}
    for name, value in inputs.items():
        tensors[name] = (
            value
            if isinstance(value, np.ndarray)
            else np.array(
                [[value]],
                dtype=np.bool_
                if isinstance(value, bool)
                else np.float32
                if isinstance(value, float)
                else np.int32,
            )
        )
    return tensors


def _sampling(**inputs):
    return convert_request(_request(**inputs), Defaults(), VOCAB)[0].sampling


def test_greedy_unless_sampling_is_asked():
    assert _sampling().temperature == 0.0
    assert _sampling(runtime_top_k=1).temperature == 0.0
    assert _sampling(runtime_top_p=0.0).temperature == 0.0  # <= 0 means unset
    assert _sampling(temperature=0.0, runtime_top_p=1.0).temperature == 0.0
    top_k = _sampling(runtime_top_k=40)
    assert (top_k.temperature, top_k.top_k) == (1.0, 40)
    top_p = _sampling(runtime_top_p=0.9)
    assert top_p.temperature == 1.0 and abs(top_p.top_p - 0.9) < 1e-6
    assert abs(_sampling(temperature=0.7).temperature - 0.7) < 1e-6


def test_defaults_and_aliases():
    row = convert_request(_request(), Defaults(max_tokens=7, exclude_input_in_output=True), VOCAB)[
        0
    ]
    assert row.sampling.max_tokens == 7 and row.exclude_input_in_output and not row.streaming
    assert _sampling(min_length=3).min_tokens == 3
    assert _sampling(min_tokens=4, min_length=3).min_tokens == 4
    seeded = _sampling(random_seed=np.array([[11]], dtype=np.uint64))
    assert seeded.seed == 11
    no_end = _sampling(end_id=-1)
    assert no_end.ignore_end_id and no_end.end_id is None
    assert _sampling(end_id=2).end_id == 2


def test_word_lists_bias_and_trimming():
    stop = np.array([[[8, 9, 10], [2, 3, -1]]], dtype=np.int32)
    bias = np.zeros((1, 20), dtype=np.float32)
    bias[0, 4] = -2.5
    row = convert_request(
        _request(stop_words_list=stop, embedding_bias=bias, input_lengths=2), Defaults(), VOCAB
    )[0]
    assert row.sampling.stop_token_ids == [[8, 9], [10]]
    assert row.sampling.embedding_bias == {4: -2.5}
    assert row.prompt_ids == [5, 6]


def test_batch_rows():
    tensors = {
        "input_ids": np.array([[5, 6, 0], [7, 8, 9]], dtype=np.int32),
        "input_lengths": np.array([[2], [3]], dtype=np.int32),
    }
    rows = convert_request(tensors, Defaults(), VOCAB)
    assert [r.prompt_ids for r in rows] == [[5, 6], [7, 8, 9]]
    assert [r.batch_index for r in rows] == [0, 1]


@pytest.mark.parametrize(
    "inputs, message",
    [
        (dict(beam_width=4), "beam_width must be 1"),
        (dict(num_return_sequences=2), "num_return_sequences must be 1"),
        (dict(runtime_top_p=1.5), "top_p (input runtime_top_p) must be in (0, 1], got 1.5"),
        (dict(runtime_top_k=-1), "top_k (input runtime_top_k) must be >= 0"),
        (dict(request_output_len=0), "max_tokens (input request_output_len) must be >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be finite"),
        (dict(input_lengths=9), "input_lengths must be in [0, 3]"),
        (dict(input_lengths=0), "input_ids must not be empty"),
        (dict(end_id=5000), "end_id must be < vocab size"),
        (dict(return_context_logits=True), "return_context_logits is not supported"),
        (dict(embedding_bias=np.zeros((1, 2000), dtype=np.float32)), "at most vocab size"),
        (dict(stop_words_list=np.array([[[1, 2], [2, 1]]], dtype=np.int32)), "stop_words_list"),
        (dict(num_top_log_probs=21), "num_top_log_probs must be <= 20, got 21"),
        (dict(num_top_log_probs=-1), "num_top_log_probs must be >= 0, got -1"),
        (dict(num_top_log_probs=2.0), "num_top_log_probs must be an integer tensor"),
        (dict(return_prompt_log_probs=1), "return_prompt_log_probs must be BOOL"),
    ],
)
def test_rejections_name_the_field(inputs, message):
    with pytest.raises(ValueError) as err:
        convert_request(_request(**inputs), Defaults(), VOCAB)
    assert message in str(err.value)


def test_stop_request():
    assert is_stop_request({"stop": np.array([[True]])})
    assert not is_stop_request({"stop": np.array([[False]])})
    assert not is_stop_request({})


def _outputs(ids: list[int], steps: list[int]) -> list[RequestOutput]:
    outs, start = [], 0
    for i, n in enumerate(steps):
        new = ids[start : start + n]
        start += n
        outs.append(
            RequestOutput(
                "r",
                new,
                [],
                start,
                finished=i == len(steps) - 1,
                finish_reason=FinishReason.LENGTH if i == len(steps) - 1 else None,
            )
        )
    return outs


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_windows_rebuild_the_text(smollm2, echo):
    from postprocessing.detokenizer import text_delta

    tokenizer = smollm2
    prompt = tokenizer.encode("Say it:")
    generated = tokenizer.encode(" こんにちは 🌊 café déjà vu, 你好！", add_special_tokens=False)
    steps = [1, 2, 1, 3, 1] + [1] * (len(generated) - 8)
    assert sum(steps) == len(generated)

    def run(streaming: bool) -> tuple[str, list[int]]:
        stream = RowStream.start("r", 0, streaming, prompt, echo_prompt=echo)
        text, ids = "", []
        for out in _outputs(generated, steps):
            stream.add(out)
            if stream.ready(out):
                t = stream.take(out)
                ids += t["output_ids"][0].tolist()
                assert t["detok_window_length"][0] == t["detok_window_ids"].shape[1]
                text += text_delta(
                    tokenizer,
                    t["detok_window_ids"][0].tolist(),
                    int(t["detok_context_length"][0]),
                    bool(t["detok_final"][0]),
                )
        return text, ids

    streamed, streamed_ids = run(True)
    whole, whole_ids = run(False)
    expected_ids = (prompt if echo else []) + generated
    assert streamed_ids == whole_ids == expected_ids
    assert streamed == whole == tokenizer.decode(expected_ids, skip_special_tokens=True)


LLM_OUTPUTS = {t.name for t in TENSORRT_LLM.outputs}


@pytest.mark.parametrize("log_probs, perf", [(False, False), (True, True)])
def test_each_response_holds_every_output_asked_for(log_probs, perf):
    stream = RowStream.start(
        "r", 3, True, [5, 6], echo_prompt=False, log_probs=log_probs, perf_metrics=perf
    )
    outs = [
        RequestOutput(
            "r",
            [10 + i],
            [-0.5 * i] if log_probs else [],
            i + 1,
            i == 4,
            FinishReason.LENGTH if i == 4 else None,
            num_prompt_tokens=2,
            num_new_blocks=1 + i // 2,
            cum_logprob=-0.5 * i,
            arrival_time=100.0,
            first_scheduled_time=100.5,
            first_token_time=101.0,
            last_token_time=101.0 + i,
        )
        for i in range(5)
    ]
    left_out = (set() if log_probs else {"cum_log_probs", "output_log_probs"}) | (
        set() if perf else {t.name for t in PERF_OUTPUTS}
    )
    left_out |= {t.name for t in TOP_LOGPROB_OUTPUTS}  # not asked
    for out in outs:
        stream.add(out)
        tensors = stream.take(out)
        assert set(tensors) == LLM_OUTPUTS - left_out  # as TensorRT-LLM: only when asked
    assert tensors["batch_index"].tolist() == [3] and tensors["llm_request_id"].tolist() == [b"r"]
    if perf:
        assert tensors["arrival_time_ns"].tolist() == [100_000_000_000]
        assert tensors["last_token_time_ns"].tolist() == [105_000_000_000]
        assert tensors["kv_cache_alloc_new_blocks"].tolist() == [3]
        assert tensors["output_log_probs"].tolist() == [[-2.0]]
        assert tensors["cum_log_probs"].tolist() == [-2.0]


def test_rows_stacked_with_an_output_only_some_rows_asked_for():
    rows = []
    for i, perf in enumerate((False, True)):
        stream = RowStream.start(f"r{i}", i, False, [5], echo_prompt=False, perf_metrics=perf)
        out = RequestOutput(
            f"r{i}",
            [7, 8][: i + 1],
            [],
            i + 1,
            True,
            FinishReason.LENGTH,
            num_prompt_tokens=1,
            num_new_blocks=2,
        )
        stream.add(out)
        rows.append(stream.take(out))
    stacked = stack_rows(rows)
    assert stacked["output_ids"].tolist() == [[[7, 0]], [[7, 8]]]
    assert stacked["kv_cache_alloc_new_blocks"].tolist() == [[0], [2]]


def test_streaming_is_refused_by_a_model_that_is_not_decoupled():
    not_decoupled = Defaults(decoupled=False)
    assert not convert_request(_request(streaming=False), not_decoupled, VOCAB)[0].streaming
    with pytest.raises(ValueError) as err:
        convert_request(_request(streaming=True), not_decoupled, VOCAB)
    assert "stream (input streaming) must be false" in str(err.value)
    assert "decoupled_mode" in str(err.value)
    assert convert_request(_request(streaming=True), Defaults(), VOCAB)[0].streaming


@pytest.mark.parametrize("reason", list(FinishReason))
def test_finish_reason_is_empty_until_the_final_response(reason):
    stream = RowStream.start("r", 0, True, [5], echo_prompt=False)
    reasons = []
    for i in range(3):
        out = RequestOutput("r", [10 + i], [], i + 1, i == 2, reason if i == 2 else None)
        stream.add(out)
        reasons.append(stream.take(out)["finish_reason"].tolist())
    assert reasons == [[b""], [b""], [reason.value.encode()]]


def test_rows_of_a_request_stack_into_one_batch():
    rows = []
    for index, ids in enumerate(([7, 8, 9], [4])):
        stream = RowStream.start(f"r{index}", index, False, [5], echo_prompt=False)
        out = RequestOutput(f"r{index}", ids, [], len(ids), True, FinishReason.END_ID)
        stream.add(out)
        rows.append(stream.take(out))
    batch = stack_rows(rows)
    assert set(batch) == set(rows[0])
    assert batch["output_ids"].tolist() == [[[7, 8, 9]], [[4, 0, 0]]]  # [batch, beam, n]
    assert batch["sequence_length"].tolist() == [[3], [1]]
    assert batch["batch_index"].tolist() == [[0], [1]]
    assert batch["finish_reason"].tolist() == [[b"end_id"], [b"end_id"]]
    assert batch["llm_request_id"].tolist() == [[b"r0"], [b"r1"]]
    assert stack_rows(rows[:1])["output_ids"].shape == (1, 1, 3)


def test_top_and_prompt_log_probs_inputs_reach_the_engine():
    sampling = _sampling(num_top_log_probs=5, return_prompt_log_probs=True)
    assert sampling.num_top_log_probs == 5 and sampling.return_prompt_log_probs
    assert _sampling().num_top_log_probs == 0 and not _sampling().return_prompt_log_probs


@pytest.mark.parametrize("streaming", [True, False])
def test_top_log_probs_per_response_and_prompt_log_probs_in_the_first_only(streaming):
    """Shapes of the contract (batch dimension left out): top_* [1, new tokens, k] aligned with
    output_log_probs; prompt_* [1, prompt(, k)] once, position 0 as 0.0 / -1."""
    k = 2
    stream = RowStream.start("r", 0, streaming, [5, 6, 7], echo_prompt=True, num_top=k)
    prompt_top_ids = [[], [6, 1], [7, 2]]
    prompt_top_logprobs = [[], [-0.1, -2.0], [-0.2, -3.0]]
    outs = [
        RequestOutput(
            "r",
            [10 + i],
            [],
            i + 1,
            i == 2,
            FinishReason.LENGTH if i == 2 else None,
            new_top_ids=[[10 + i, 3]],
            new_top_logprobs=[[-0.5, -1.5 - i]],
            prompt_logprobs=[0.0, -0.1, -0.2] if i == 0 else None,
            prompt_top_ids=prompt_top_ids if i == 0 else None,
            prompt_top_logprobs=prompt_top_logprobs if i == 0 else None,
        )
        for i in range(3)
    ]
    responses = []
    for out in outs:
        stream.add(out)
        if stream.ready(out):
            responses.append(stream.take(out))
    first = responses[0]
    assert first["prompt_log_probs"].dtype == np.float32
    np.testing.assert_allclose(first["prompt_log_probs"], [[0.0, -0.1, -0.2]])
    assert first["prompt_top_token_ids"].dtype == np.int32
    assert first["prompt_top_token_ids"].tolist() == [[[-1, -1], [6, 1], [7, 2]]]
    np.testing.assert_allclose(
        first["prompt_top_log_probs"], [[[0.0, 0.0], [-0.1, -2.0], [-0.2, -3.0]]]
    )
    for later in responses[1:]:
        assert not {"prompt_log_probs", "prompt_top_log_probs", "prompt_top_token_ids"} & set(later)
    ids = [r["top_token_ids"] for r in responses]
    assert all(a.dtype == np.int32 and a.ndim == 3 and a.shape[2] == k for a in ids)
    assert [t for r in ids for t in r[0, :, 0].tolist()] == [10, 11, 12]
    shapes = [(1, 1, k)] * 3 if streaming else [(1, 3, k)]
    assert [r["top_log_probs"].shape for r in responses] == shapes
    np.testing.assert_allclose(responses[-1]["top_log_probs"][0, -1], [-0.5, -3.5])
