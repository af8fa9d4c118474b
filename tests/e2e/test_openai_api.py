"""The OpenAI-compatible front end (ensemble/openai_server) with the official `openai` client,
against the session's real tritonserver: its texts equal the ensemble's, streamed deltas
concatenate to the unstreamed text, stops, lengths, n, usage, log-probs and errors as OpenAI
clients expect them."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from ensemble.openai_server.served_model import default_name
from ensemble.server import free_port
from ensemble.token_client import generate, request_inputs
from preprocessing.tokenizer import apply_chat_template, default_end_id, default_pad_id, encode
from tests.e2e.clients import grpc_request, metric, metrics

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.e2e
PROJECT = Path(__file__).resolve().parents[2]
MODEL = default_name("default")
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def front_end(triton, tmp_path_factory):
    """`python -m ensemble.openai_server` beside the session's tritonserver."""
    port = free_port()
    log = tmp_path_factory.mktemp("openai") / "openai.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ensemble.openai_server",
            f"--triton-url={triton.grpc}",
            f"--metrics-url={triton.metrics}",
            f"--port={port}",
        ],
        cwd=PROJECT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://localhost:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.3)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(front_end):
    return openai.OpenAI(base_url=f"{front_end}/v1", api_key="unused", max_retries=0)


def engine_ids(triton, tokenizer, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What tensorrt_llm generates greedily for these ids (the token client's request)."""
    inputs = request_inputs(
        prompt_ids, max_tokens, default_end_id(tokenizer), default_pad_id(tokenizer), True
    )
    return generate(triton.grpc, "tensorrt_llm", inputs)


def ensemble_text(triton, text: str, max_tokens: int, chat: bool = False, **inputs) -> str:
    request = {"text_input": text, "max_tokens": max_tokens, "apply_chat_template": chat, **inputs}
    result = grpc_request(triton.grpc, "ensemble", request)
    assert result.error is None, result.error
    return result.text()


def test_models_health_and_metrics(client, front_end):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(f"{front_end}/health", timeout=5).status_code == 200
    metrics = requests.get(f"{front_end}/metrics", timeout=5)
    assert metrics.status_code == 200 and "nv_trt_llm_request_metrics" in metrics.text


def test_completion_equals_the_ensemble_streamed_or_not(client, triton, tokenizer):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    (choice,) = reply.choices
    assert choice.text == ensemble_text(triton, PROMPT, 24)
    ids = engine_ids(triton, tokenizer, encode(tokenizer, PROMPT), 24)
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(encode(tokenizer, PROMPT))
    assert reply.usage.completion_tokens == len(ids)
    assert choice.finish_reason == ("length" if len(ids) == 24 else "stop")

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 3  # streamed, not one piece
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_chat_uses_the_template_and_equals_the_ensemble(client, triton, tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0
    )
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == ensemble_text(triton, QUESTION, 32, chat=True)
    prompt_ids = apply_chat_template(tokenizer, QUESTION)
    ids = engine_ids(triton, tokenizer, prompt_ids, 32)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(ids) < 32  # a short answer, ended by the model
    assert choice.finish_reason == "stop"

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.usage is None for c in chunks)  # usage only when include_usage asks


def test_stop_strings_end_the_text_before_them(client, triton):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text.split()[2]  # a word in the middle of the greedy text
    expected = text[: text.index(stop)]
    for stops in (stop, [stop, "never appears"]):
        reply = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stops
        )
        assert reply.choices[0].text == expected
        assert reply.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    # The ensemble's stop_words also stop on " word" and drop its space; with the space in the
    # stop string both cut at the same place.
    spaced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=" " + stop
    )
    assert spaced.choices[0].text == expected.removesuffix(" ")
    assert ensemble_text(triton, PROMPT, 24, stop_words=[" " + stop]) == spaced.choices[0].text


def test_max_tokens_ends_with_length(client):
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
            max_tokens=3,
            temperature=0,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        chunks = list(reply) if stream else [reply]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 3


def test_n_choices_have_indices_0_and_1_and_seeds(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2)
    reply = client.completions.create(**args)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text != reply.choices[1].text  # seeds 7 and 8
    for index, seed in enumerate((7, 8)):  # choice i is seed + i
        alone = client.completions.create(**{**args, "n": 1, "seed": seed})
        assert alone.choices[0].text == reply.choices[index].text
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in reply.choices]


def test_token_id_prompts_and_echo(client, tokenizer):
    ids = encode(tokenizer, PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text
    prompts = [PROMPT, "Water boils at"]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]  # prompt p, choice i: p * n + i
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert both.choices[2 * p].text == both.choices[2 * p + 1].text == alone.choices[0].text


# ---- log-probs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """log_softmax of the default model's logits (transformers) at every position of a sequence:
    what the engine computes, which tests/backend/test_engine_fidelity.py holds within 1e-4."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from backend.loading.model_paths import resolve_model
    from tests.hf_reference import reference_logprobs

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default"), dtype=torch.float32)
    model.eval()
    return lambda ids: reference_logprobs(model, ids).numpy()  # row i: the token after ids[i]


def test_chat_logprobs_of_the_chosen_tokens(client, triton, tokenizer, reference):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    prompt = apply_chat_template(tokenizer, QUESTION)
    ids = prompt + engine_ids(triton, tokenizer, prompt, 12)
    expected = reference(ids)
    for i, entry in enumerate(content):
        row = expected[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[ids[len(prompt) + i]]), abs=1e-4)
        assert bytes(entry.bytes).decode() == entry.token


def _has_top_log_probs(triton) -> bool:
    client = grpcclient.InferenceServerClient(triton.grpc)
    try:
        config = client.get_model_config("tensorrt_llm", as_json=True)["config"]
    finally:
        client.close()
    return any(i["name"] == "num_top_log_probs" for i in config["input"])


@pytest.fixture
def top_log_probs(triton):
    if not _has_top_log_probs(triton):
        pytest.skip("tensorrt_llm has no num_top_log_probs input yet (the logprobs branch)")


def test_chat_top_logprobs_equal_the_log_softmax(
    client, triton, tokenizer, reference, top_log_probs
):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = reply.choices[0].logprobs.content
    prompt = apply_chat_template(tokenizer, QUESTION)
    ids = prompt + engine_ids(triton, tokenizer, prompt, 8)
    assert len(content) == len(ids) - len(prompt)
    expected = reference(ids)
    for i, entry in enumerate(content):
        row = expected[len(prompt) - 1 + i]
        order = np.argsort(row)[::-1]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row[order[:5]].tolist(), abs=1e-4
        )
        if row[order[4]] - row[order[5]] > 1e-3:  # no near-tie at the edge: the same 5 tokens
            assert {t.token for t in entry.top_logprobs} == {
                tokenizer.decode([int(b)], skip_special_tokens=False) for b in order[:5]
            }
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_score_the_prompt_as_lm_eval_does(
    client, tokenizer, reference, top_log_probs, max_tokens
):
    """lm-eval's local-completions: prompt = context + continuation, echo, logprobs 1,
    temperature 0; it reads token_logprobs[ctxlen:-1] (max_tokens 1) and top_logprobs."""
    context, continuation = "The capital of France is", " Paris"
    reply = client.completions.create(
        model=MODEL,
        prompt=context + continuation,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        echo=True,
    )
    ids = encode(tokenizer, context + continuation)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens[: len(ids)] == [
        tokenizer.decode([i], skip_special_tokens=False) for i in ids
    ]
    assert len(logprobs.tokens) == len(ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference(ids)
    for position in range(1, len(ids)):
        row = expected[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(
            float(row[ids[position]]), abs=1e-4
        )
        greedy = int(np.argmax(row))
        top = logprobs.top_logprobs[position]
        assert top[tokenizer.decode([greedy], skip_special_tokens=False)] == pytest.approx(
            float(row[greedy]), abs=1e-4
        )
    assert reply.choices[0].text.startswith(context + continuation)
    assert reply.usage.completion_tokens == max_tokens


def test_a_scored_continuation_keeps_its_token_when_it_is_the_end_id(client, tokenizer, reference):
    """lm-eval drops the last token's log-prob (token_logprobs[ctxlen:-1]): when the greedy next
    token is the end id it must still come back, or the continuation's last token is lost."""
    prompt = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\nYes."
    ids = encode(tokenizer, prompt)
    expected = reference(ids)[-1]
    end_id = int(np.argmax(expected))
    assert end_id == default_end_id(tokenizer)  # the point of this prompt
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[-1] == pytest.approx(float(expected[end_id]), abs=1e-4)
    assert reply.choices[0].text == prompt and reply.choices[0].finish_reason == "stop"


# ---- errors --------------------------------------------------------------------------------------
def _error_shape(exc) -> dict:
    body = exc.body
    assert set(body) >= {"message", "type", "param", "code"}, body
    return body


def test_bad_requests_get_openai_errors(client, front_end):
    with pytest.raises(openai.NotFoundError) as found:
        client.completions.create(model="no-such-model", prompt="Hi")
    assert _error_shape(found.value)["code"] == "model_not_found"
    cases = [
        (dict(temperature=5), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=50), "logprobs"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(suffix="x"), "suffix"),
        (dict(prompt="word " * 600), None),  # longer than max_seq_len: the engine says so
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(**{"model": MODEL, "prompt": "Hi", **extra})
        body = _error_shape(bad.value)
        assert body["type"] == "invalid_request_error"
        if param:
            assert body["param"] == param, body
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], top_logprobs=3
        )
    assert _error_shape(bad.value)["param"] == "top_logprobs"
    response = requests.post(f"{front_end}/v1/chat/completions", data=b"{not json", timeout=5)
    assert response.status_code == 400 and set(response.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert requests.get(f"{front_end}/v1/nothing", timeout=5).status_code == 404


def test_unreachable_triton_reads_503(tmp_path):
    """A front end whose tritonserver is not there: not healthy, and requests get 503."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ensemble.openai_server",
            f"--triton-url=localhost:{free_port()}",
            f"--port={port}",
        ],
        cwd=PROJECT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://localhost:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = requests.get(f"{url}/health", timeout=2)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.3)
        assert health.status_code == 503
        unreachable = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            unreachable.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert failed.value.status_code == 503
        assert _error_shape(failed.value)["code"] == "service_unavailable"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_streamed_logprobs_concatenate_to_the_unstreamed_ones(client, top_log_probs):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**args).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True)]
    # The same tokens; values within 1e-4 (a cached prefix or another batch may round apart).
    joined = {name: [x for p in parts if p for x in getattr(p, name)] for name in vars(whole)}
    assert joined["tokens"] == whole.tokens and joined["text_offset"] == whole.text_offset
    assert joined["token_logprobs"][0] is None is whole.token_logprobs[0]
    assert joined["token_logprobs"][1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-4)
    for streamed_top, top in zip(joined["top_logprobs"][1:], whole.top_logprobs[1:]):
        assert streamed_top == pytest.approx(top, abs=1e-4)
    chat = dict(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [
        entry
        for c in client.chat.completions.create(**chat, stream=True)
        if c.choices and c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole]
    for entry, expected in zip(streamed, whole):
        assert entry.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [t.token for t in expected.top_logprobs]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_engine_request(front_end, triton, stream):
    def active() -> float:
        return metric(metrics(triton.metrics), "nv_trt_llm_request_metrics", request_type="active")

    body = {
        "model": MODEL,
        "prompt": "Count from one to one thousand:",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": stream,
    }
    connection = http.client.HTTPConnection(urlparse(front_end).netloc, timeout=60)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    deadline = time.monotonic() + 60
    while active() < 1:  # still connected: the request reaches the engine and runs
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.1)
    connection.close()  # hang up mid-request
    deadline = time.monotonic() + 15  # 480 tokens take far longer on a CPU
    while active() > 0:
        assert time.monotonic() < deadline, "the engine request lives on"
        time.sleep(0.2)


def test_multibyte_text_streams_exactly(client, triton):
    question = "Translate into French: The coffee at the café is très bon. Answer in French."
    args = dict(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0
    )
    text = client.chat.completions.create(**args).choices[0].message.content
    assert any(ord(c) > 127 for c in text), text  # the case this test is for
    streamed = client.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert text == ensemble_text(triton, question, 40, chat=True)
    scored = client.chat.completions.create(**args, logprobs=True)
    content = scored.choices[0].logprobs.content
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8") == text


def test_penalties_and_stop_token_ids_reach_the_engine(client, triton, tokenizer):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.5}
    penalized = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **penalties
    )
    assert penalized.choices[0].text != plain.choices[0].text
    assert penalized.choices[0].text == ensemble_text(
        triton, PROMPT, 24, **{k: np.float32(v) for k, v in penalties.items()}
    )
    ids = engine_ids(triton, tokenizer, encode(tokenizer, PROMPT), 24)
    first = ids.index(ids[3])
    stopped = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [ids[3]]},
    )
    assert stopped.choices[0].text == tokenizer.decode(ids[:first], skip_special_tokens=True)
    assert stopped.choices[0].finish_reason == "stop"
