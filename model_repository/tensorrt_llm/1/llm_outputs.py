"""Engine outputs of one row -> the output tensors of its `tensorrt_llm` responses (numpy only).

Streamed pieces concatenate to the non-streamed result: the ids shown are the prompt (unless
exclude_input_in_output) followed by the generated ids; a streaming response carries the ids not
shown yet, a non-streaming one all of them. The detok_* outputs give the postprocessing model what
it needs to turn a piece into exact text without state of its own: a window of ids starting a few
ids before the new ones, how many of those were already shown, and whether this is the last piece.

A response carries every output (the ensemble needs each in every response when its client asks
for all of them). Perf metrics are zero unless the request asked for them (return_perf_metrics),
log-probs empty unless asked (return_log_probs): TensorRT-LLM leaves them out then.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.request import RequestOutput
from ensemble.tensors import PERF_OUTPUTS
from postprocessing.detokenizer import window_start

_NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}


@dataclass
class RowStream:
    """What has been shown of one row so far. Only the response thread touches it."""

    handle: str                                         # the engine request id
    batch_index: int
    streaming: bool
    log_probs: bool = False                             # return_log_probs
    perf_metrics: bool = False                          # return_perf_metrics
    shown: list[int] = field(default_factory=list)     # prompt (if echoed) + generated ids so far
    num_sent: int = 0                                   # of `shown`, already sent
    logprobs: list[float] = field(default_factory=list)
    num_logprobs_sent: int = 0
    num_generated: int = 0

    @classmethod
    def start(cls, handle: str, batch_index: int, streaming: bool, prompt_ids: list[int],
              echo_prompt: bool, log_probs: bool = False, perf_metrics: bool = False) -> "RowStream":
        return cls(handle, batch_index, streaming, log_probs, perf_metrics,
                   shown=list(prompt_ids) if echo_prompt else [])

    def add(self, out: RequestOutput) -> None:
        self.shown += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.num_generated += len(out.new_token_ids)

    def ready(self, out: RequestOutput) -> bool:
        """Whether a response is due after `out`: every step when streaming, else only at the end."""
        return out.finished or (self.streaming and len(self.shown) > self.num_sent)

    def take(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """Tensors of the next response (without the batch dimension added), and mark them sent."""
        start_sent = self.num_sent if self.streaming else 0
        new_ids = self.shown[start_sent:]
        start = window_start(start_sent)
        window = self.shown[start:]
        if self.log_probs:
            new_logprobs = self.logprobs[self.num_logprobs_sent:] if self.streaming else self.logprobs
            cum_logprob = out.cum_logprob
        else:
            new_logprobs, cum_logprob = [], 0.0
        tensors = {
            "output_ids": _i32([new_ids]),
            "sequence_length": _i32([len(new_ids)]),
            "cum_log_probs": np.array([cum_logprob], dtype=np.float32),
            "output_log_probs": np.array([new_logprobs], dtype=np.float32).reshape(1, -1),
            "batch_index": _i32([self.batch_index]),
            "sequence_index": _i32([0]),
            "finish_reason": np.array([_reason(out).encode()], dtype=np.object_),
            "detok_window_ids": _i32([window]),
            "detok_window_length": _i32([len(window)]),
            "detok_context_length": _i32([start_sent - start]),
            "detok_final": np.array([out.finished], dtype=np.bool_),
            "llm_request_id": np.array([self.handle.encode()], dtype=np.object_),
        }
        tensors.update(perf_tensors(out if self.perf_metrics else None))
        self.num_sent = len(self.shown)
        self.num_logprobs_sent = len(self.logprobs)
        return tensors


def stack_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The tensors of several rows as one batch (one response per request when not decoupled):
    ragged ids and log-probs are padded with zeros; sequence_length and detok_window_length
    say how many are real."""
    stacked = {}
    for name in rows[0]:
        arrays = [row[name] for row in rows]
        shape = tuple(max(sizes) for sizes in zip(*(a.shape for a in arrays)))
        dtype = arrays[0].dtype
        out = np.full((len(arrays), *shape), b"" if dtype == np.object_ else 0, dtype=dtype)
        for i, a in enumerate(arrays):
            out[(i, *(slice(0, n) for n in a.shape))] = a
        stacked[name] = out
    return stacked


def _reason(out: RequestOutput) -> str:
    return out.finish_reason.value if out.finished and out.finish_reason else ""


def perf_tensors(out: RequestOutput | None) -> dict[str, np.ndarray]:
    """The perf-metric outputs of `out`; zeros for None."""
    if out is None:
        return {t.name: np.zeros(1, dtype=_NUMPY[t.dtype]) for t in PERF_OUTPUTS}
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
