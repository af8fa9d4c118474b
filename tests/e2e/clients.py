"""Small clients for the e2e tests: what a user's script does with tritonclient and plain HTTP."""

from __future__ import annotations

import json
import queue
import re
import time
from dataclasses import dataclass, field

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

# ensemble input -> numpy dtype (what tensorrtllm_backend clients send)
ENSEMBLE_DTYPES = {
    "text_input": np.object_,
    "max_tokens": np.int32,
    "stream": np.bool_,
    "end_id": np.int32,
    "pad_id": np.int32,
    "top_k": np.int32,
    "top_p": np.float32,
    "temperature": np.float32,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "length_penalty": np.float32,
    "min_tokens": np.int32,
    "min_length": np.int32,
    "seed": np.uint64,
    "random_seed": np.uint64,
    "bad_words": np.object_,
    "stop_words": np.object_,
    "exclude_input_in_output": np.bool_,
    "return_log_probs": np.bool_,
    "return_perf_metrics": np.bool_,
    "beam_width": np.int32,
    "num_return_sequences": np.int32,
    "embedding_bias_words": np.object_,
    "embedding_bias_weights": np.float32,
    "return_generation_logits": np.bool_,
    "return_context_logits": np.bool_,
    "apply_chat_template": np.bool_,
}
LLM_DTYPES = {
    "input_ids": np.int32,
    "num_top_log_probs": np.int32,
    "return_prompt_log_probs": np.bool_,
    "input_lengths": np.int32,
    "request_output_len": np.int32,
    "end_id": np.int32,
    "streaming": np.bool_,
    "stop": np.bool_,
    "runtime_top_k": np.int32,
    "runtime_top_p": np.float32,
    "temperature": np.float32,
    "return_log_probs": np.bool_,
    "stop_words_list": np.int32,
    "bad_words_list": np.int32,
    "embedding_bias": np.float32,
    "exclude_input_in_output": np.bool_,
    "beam_width": np.int32,
}


def tensor(name: str, value, dtype=None, client=grpcclient):
    """One batch row: scalars become [1, 1], lists [1, n] (arrays are sent as given)."""
    if isinstance(value, np.ndarray):
        arr = value
    else:
        dtype = dtype or ENSEMBLE_DTYPES.get(name) or LLM_DTYPES[name]
        items = value if isinstance(value, (list, tuple)) else [value]
        if dtype == np.object_:
            items = [v.encode("utf-8") if isinstance(v, str) else v for v in items]
        arr = np.array([items], dtype=dtype)
    inp = client.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr)
    return inp


def infer(
    protocol: str, url: str, model: str, inputs: dict, request_id: str = "", timeout: float = 120.0
) -> dict[str, np.ndarray]:
    """One plain `infer()` call (not a stream) with tritonclient's "http" or "grpc" client: what
    a client of a model that is not decoupled does. Raises InferenceServerException on errors."""
    client_module = httpclient if protocol == "http" else grpcclient
    options = {"network_timeout": timeout} if protocol == "http" else {}
    client = client_module.InferenceServerClient(url, **options)
    try:
        result = client.infer(
            model,
            [tensor(k, v, client=client_module) for k, v in inputs.items()],
            request_id=request_id,
        )
        response = result.get_response()
        names = (
            [o["name"] for o in response["outputs"]]
            if protocol == "http"
            else [o.name for o in response.outputs]
        )
        return {name: result.as_numpy(name) for name in names}
    finally:
        client.close()


@dataclass
class StreamResult:
    responses: list[dict] = field(default_factory=list)  # output name -> numpy array
    error: str | None = None

    def text(self) -> str:
        return "".join(
            r["text_output"].reshape(-1)[0].decode("utf-8")
            for r in self.responses
            if "text_output" in r
        )

    def ids(self) -> list[int]:
        return [
            int(t) for r in self.responses if "output_ids" in r for t in r["output_ids"].reshape(-1)
        ]


class GrpcStream:
    """One gRPC stream (one client) for one request, as end_to_end_grpc_client.py does."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def send(self, model: str, inputs: dict, request_id: str = "", outputs=None) -> None:
        tensors = [
            v if isinstance(v, grpcclient.InferInput) else tensor(k, v) for k, v in inputs.items()
        ]
        requested = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        self.client.async_stream_infer(
            model,
            tensors,
            request_id=request_id,
            outputs=requested,
            enable_empty_final_response=True,
        )

    def collect(self, timeout: float = 120.0, limit: int | None = None) -> StreamResult:
        """Responses until the final flag (or an error, or `limit` data responses)."""
        result = StreamResult()
        deadline = time.monotonic() + timeout
        while True:
            out, error = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                result.error = str(error)
                return result
            response = out.get_response()
            names = [o.name for o in response.outputs]
            if names:
                result.responses.append({n: out.as_numpy(n) for n in names})
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return result
            if limit is not None and len(result.responses) >= limit:
                return result

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def grpc_request(
    url: str, model: str, inputs: dict, request_id: str = "", timeout: float = 120.0
) -> StreamResult:
    stream = GrpcStream(url)
    try:
        stream.send(model, inputs, request_id)
        return stream.collect(timeout)
    finally:
        stream.close()


def generate(http_url: str, model: str, payload: dict, timeout: float = 120.0) -> requests.Response:
    return requests.post(
        f"http://{http_url}/v2/models/{model}/generate", json=payload, timeout=timeout
    )


def generate_stream(http_url: str, model: str, payload: dict, timeout: float = 120.0) -> list[dict]:
    """The SSE events of /generate_stream, parsed."""
    response = requests.post(
        f"http://{http_url}/v2/models/{model}/generate_stream",
        json=payload,
        stream=True,
        timeout=timeout,
    )
    events = []
    for line in response.iter_lines(decode_unicode=False):
        if line.startswith(b"data: "):
            events.append(json.loads(line[len(b"data: ") :].decode("utf-8")))
    return events


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, frozenset of (label, value))): sample value}."""
    samples = {}
    for line in requests.get(url, timeout=10).text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= set(ls)]
    if not found:
        raise KeyError(f"no sample {name}{labels}")
    return sum(found)
