"""Engine outputs of one row -> the output tensors of its `tensorrt_llm` responses (numpy only).

Streamed pieces concatenate to the non-streamed result: the ids shown are the prompt (unless
exclude_input_in_output) followed by the generated ids; a streaming response carries the ids not
shown yet, a non-streaming one all of them. The detok_* outputs give the postprocessing model what
it needs to turn a piece into exact text without state of its own: a window of ids starting a few
ids before the new ones, how many of those were already shown, and whether this is the last piece.

As in TensorRT-LLM, the optional outputs are left out unless asked: the perf metrics without
return_perf_metrics, the log-probs without return_log_probs. The ensemble then leaves them out of
its responses too, and every response costs the sender half the tensors.

Ours, for clients of this model itself (the ensemble does not carry them): with
num_top_log_probs = k > 0 every response has `top_log_probs` [1, n, k] and `top_token_ids`
[1, n, k] for its n generated tokens (aligned with `output_log_probs`); with
return_prompt_log_probs the first response that carries tokens has `prompt_log_probs`
[1, prompt] and, with k > 0, `prompt_top_log_probs` / `prompt_top_token_ids` [1, prompt, k],
whose position-0 row (no context) is 0.0 / -1. Later responses leave the prompt ones out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.request import RequestOutput
from postprocessing.detokenizer import window_start


@dataclass
class RowStream:
    """What has been shown of one row so far. Only the response thread touches it."""

    handle: str  # the engine request id
    batch_index: int
    streaming: bool
    log_probs: bool = False  # return_log_probs
    perf_metrics: bool = False  # return_perf_metrics
    num_top: int = 0  # num_top_log_probs
    shown: list[int] = field(default_factory=list)  # prompt (if echoed) + generated ids so far
    num_sent: int = 0  # of `shown`, already sent
    logprobs: list[float] = field(default_factory=list)
    num_logprobs_sent: int = 0
    num_generated: int = 0
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    num_top_sent: int = 0
    prompt: RequestOutput | None = None  # the output with the prompt log-probs, until sent

    @classmethod
    def start(
        cls,
        handle: str,
        batch_index: int,
        streaming: bool,
        prompt_ids: list[int],
        echo_prompt: bool,
        log_probs: bool = False,
        perf_metrics: bool = False,
        num_top: int = 0,
    ) -> "RowStream":
        return cls(
            handle,
            batch_index,
            streaming,
            log_probs,
            perf_metrics,
            num_top,
            shown=list(prompt_ids) if echo_prompt else [],
        )

    def add(self, out: RequestOutput) -> None:
        self.shown += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.num_generated += len(out.new_token_ids)
        if out.new_top_ids:
            self.top_ids += out.new_top_ids
            self.top_logprobs += out.new_top_logprobs
        if out.prompt_logprobs is not None:
            self.prompt = out

    def ready(self, out: RequestOutput) -> bool:
        """Whether a response is due after `out`: every step when streaming, else only at the
        end."""
        return out.finished or (self.streaming and len(self.shown) > self.num_sent)

    def take(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """Tensors of the next response (without the batch dimension added), and mark them sent."""
        start_sent = self.num_sent if self.streaming else 0
        new_ids = self.shown[start_sent:]
        start = window_start(start_sent)
        window = self.shown[start:]
        tensors = {
            "output_ids": _i32([new_ids]),
            "sequence_length": _i32([len(new_ids)]),
            "batch_index": _i32([self.batch_index]),
            "sequence_index": _i32([0]),
            "finish_reason": np.array([_reason(out).encode()], dtype=np.object_),
            "detok_window_ids": _i32([window]),
            "detok_window_length": _i32([len(window)]),
            "detok_context_length": _i32([start_sent - start]),
            "detok_final": np.array([out.finished], dtype=np.bool_),
            "llm_request_id": np.array([self.handle.encode()], dtype=np.object_),
        }
        if self.log_probs:
            new_logprobs = (
                self.logprobs[self.num_logprobs_sent :] if self.streaming else self.logprobs
            )
            tensors["cum_log_probs"] = np.array([out.cum_logprob], dtype=np.float32)
            tensors["output_log_probs"] = np.array([new_logprobs], dtype=np.float32).reshape(1, -1)
        if self.num_top:
            start_top = self.num_top_sent if self.streaming else 0
            tensors["top_log_probs"] = _top(self.top_logprobs[start_top:], self.num_top, np.float32)
            tensors["top_token_ids"] = _top(self.top_ids[start_top:], self.num_top, np.int32)
            self.num_top_sent = len(self.top_ids)
        if self.prompt is not None:
            tensors.update(prompt_tensors(self.prompt, self.num_top))
            self.prompt = None
        if self.perf_metrics:
            tensors.update(perf_tensors(out))
        self.num_sent = len(self.shown)
        self.num_logprobs_sent = len(self.logprobs)
        return tensors


def _top(rows: list[list], k: int, dtype) -> np.ndarray:
    """[1, positions, k] from each position's k values (k is at most the vocabulary size)."""
    k = len(rows[0]) if rows else k
    return np.array(rows, dtype=dtype).reshape(1, len(rows), k)


def prompt_tensors(out: RequestOutput, k: int) -> dict[str, np.ndarray]:
    """The prompt log-prob outputs of `out`; position 0 (no context) reads 0.0, id -1."""
    tensors = {"prompt_log_probs": np.array([out.prompt_logprobs], dtype=np.float32)}
    if k and out.prompt_top_ids is not None:
        rows = out.prompt_top_logprobs[1:]
        width = len(rows[0]) if rows else k
        values = np.zeros((1, len(out.prompt_logprobs), width), dtype=np.float32)
        ids = np.full(values.shape, -1, dtype=np.int32)
        if rows:
            values[0, 1:] = rows
            ids[0, 1:] = out.prompt_top_ids[1:]
        tensors["prompt_top_log_probs"] = values
        tensors["prompt_top_token_ids"] = ids
    return tensors


def stack_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The tensors of several rows as one batch (one response per request when not decoupled):
    ragged ids and log-probs are padded with zeros; sequence_length and detok_window_length
    say how many are real. An optional output asked for by some rows only is zero in the others."""
    stacked = {}
    for name in dict.fromkeys(name for row in rows for name in row):
        arrays = [row.get(name) for row in rows]
        present = [a for a in arrays if a is not None]
        shape = tuple(max(sizes) for sizes in zip(*(a.shape for a in present)))
        dtype = present[0].dtype
        out = np.full((len(arrays), *shape), b"" if dtype == np.object_ else 0, dtype=dtype)
        for i, a in enumerate(arrays):
            if a is not None:
                out[(i, *(slice(0, n) for n in a.shape))] = a
        stacked[name] = out
    return stacked


def _reason(out: RequestOutput) -> str:
    return out.finish_reason.value if out.finished and out.finish_reason else ""


def perf_tensors(out: RequestOutput) -> dict[str, np.ndarray]:
    """The perf-metric outputs of `out`."""
    return {
        "kv_cache_alloc_new_blocks": _i32([out.num_new_blocks]),
        "kv_cache_reused_blocks": _i32([out.num_reused_blocks]),
        "kv_cache_alloc_total_blocks": _i32([out.num_new_blocks + out.num_reused_blocks]),
        "arrival_time_ns": _ns(out.arrival_time),
        "first_scheduled_time_ns": _ns(out.first_scheduled_time),
        "first_token_time_ns": _ns(out.first_token_time),
        "last_token_time_ns": _ns(out.last_token_time),
        "acceptance_rate": np.zeros(1, dtype=np.float32),
        "total_accepted_draft_tokens": _i32([0]),
        "total_draft_tokens": _i32([0]),
    }


def _i32(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _ns(seconds: float | None) -> np.ndarray:
    return np.array([0 if not seconds else int(seconds * 1e9)], dtype=np.int64)
