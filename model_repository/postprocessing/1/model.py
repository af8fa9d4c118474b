"""Triton adapter of the detokenizer: a window of token ids in, the new text out.

Stateless exact streaming (see postprocessing/detokenizer.py): the LLM sends, per response, the
ids from a few before the new ones (TOKENS_BATCH, SEQUENCE_LENGTH), how many of them were already
shown (WINDOW_CONTEXT_LENGTH) and whether it is the last piece (IS_FINAL). Without these two
inputs it decodes the whole sequence, as TensorRT-LLM's postprocessing does. LLM_REQUEST_ID lets
it stop the LLM when the ensemble request was cancelled (see stop_forwarder.py).
"""

from __future__ import annotations

import numpy as np

from ensemble.environment import check_stub_numpy
from ensemble.params import get_setting, parameters, tokenizer_dir
from ensemble.request_loop import respond
from ensemble.stub_watch import dismiss, watch_stub
from postprocessing.detokenizer import text_delta
from preprocessing.tokenizer import load_tokenizer

from stop_forwarder import StopForwarder


class TritonPythonModel:
    def initialize(self, args):
        check_stub_numpy()
        params = parameters(args["model_config"])
        self.tokenizer = load_tokenizer(tokenizer_dir(params))
        self.skip_special_tokens = get_setting(params, "skip_special_tokens")
        self.stop_forwarder = StopForwarder()
        self.stub_watch = watch_stub(args["model_name"])  # last: a failed load is not a death

    def finalize(self):
        dismiss(self.stub_watch)

    def execute(self, requests):
        return respond("postprocessing", requests, self.answer)

    def answer(self, request, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        text = self.convert(tensors)
        self.forward_cancellation(request, tensors)
        return {"OUTPUT": text}

    def forward_cancellation(self, request, tensors: dict[str, np.ndarray]) -> None:
        if "LLM_REQUEST_ID" in tensors:
            handle = tensors["LLM_REQUEST_ID"].reshape(-1)[0]
            final = bool(tensors.get("IS_FINAL", np.ones(1, np.bool_)).reshape(-1)[0])
            self.stop_forwarder.observe(
                request, handle.decode() if isinstance(handle, bytes) else str(handle), final
            )

    def convert(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        tokens = tensors["TOKENS_BATCH"]  # [batch, beams, n]
        lengths = tensors["SEQUENCE_LENGTH"]  # [batch, beams]
        batch, beams = tokens.shape[0], tokens.shape[1]
        context = tensors.get("WINDOW_CONTEXT_LENGTH", np.zeros((batch, 1), np.int32))
        final = tensors.get("IS_FINAL", np.ones((batch, 1), np.bool_))
        out = np.empty((batch, beams), dtype=np.object_)
        for b in range(batch):
            for k in range(beams):
                n = int(lengths[b, k])
                if not 0 <= n <= tokens.shape[2]:
                    raise ValueError(f"SEQUENCE_LENGTH must be in [0, {tokens.shape[2]}], got {n}")
                ids = [int(t) for t in tokens[b, k, :n]]
                text = text_delta(
                    self.tokenizer,
                    ids,
                    int(context[b].reshape(-1)[0]),
                    bool(final[b].reshape(-1)[0]),
                    skip_special_tokens=self.skip_special_tokens,
                )
                out[b, k] = text.encode("utf-8")
        return out
