"""A token-level client of `tensorrt_llm`, the way TensorRT-LLM's inflight_batcher_llm_client talks
to it: tokenize here, send ids over a gRPC stream, detokenize the ids that come back.

  python -m ensemble.token_client --url localhost:8001 --text "Born in north-east France," \
      --max-tokens 16
  python -m ensemble.token_client --text "..." --streaming          # ids printed as they arrive
  python -m ensemble.token_client --text "..." --json               # one JSON object

The tokenizer is the served model's (--model as given to `ensemble build`, or --tokenizer-dir), with
the repository's default rules: special tokens added, end/pad ids from the tokenizer. Needs
tritonclient[grpc] (the `serve` extra).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from preprocessing.tokenizer import default_end_id, default_pad_id, encode, load_tokenizer


def as_input(name: str, value: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    tensor.set_data_from_numpy(value)
    return tensor


def request_inputs(
    ids: list[int], max_tokens: int, end_id: int, pad_id: int, streaming: bool
) -> list[grpcclient.InferInput]:
    """One batch row, tensorrt_llm's tensor names and types."""

    def scalar(value, dtype):
        return np.array([[value]], dtype=dtype)

    return [
        as_input("input_ids", np.array([ids], dtype=np.int32)),
        as_input("input_lengths", scalar(len(ids), np.int32)),
        as_input("request_output_len", scalar(max_tokens, np.int32)),
        as_input("end_id", scalar(end_id, np.int32)),
        as_input("pad_id", scalar(pad_id, np.int32)),
        as_input("streaming", scalar(streaming, np.bool_)),
        # only the generated ids come back, whatever the repository's default
        as_input("exclude_input_in_output", scalar(True, np.bool_)),
    ]


def generate(
    url: str,
    model: str,
    inputs: list[grpcclient.InferInput],
    request_id: str = "1",
    on_ids=None,
    timeout: float = 600.0,
) -> list[int]:
    """Send one request on a gRPC stream; the generated ids once the final response arrived.
    `on_ids(new_ids)` sees each response's ids as it arrives."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(
            model, inputs, request_id=request_id, enable_empty_final_response=True
        )
        ids: list[int] = []
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            output_ids = result.as_numpy("output_ids")
            if output_ids is not None and output_ids.size:
                # [batch, beam, tokens]; sequence_length says how many of them are real
                length = int(result.as_numpy("sequence_length").reshape(-1)[0])
                new = [int(t) for t in output_ids.reshape(-1)[:length]]
                ids += new
                if on_ids is not None:
                    on_ids(new)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return ids
    finally:
        client.stop_stream()
        client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ensemble.token_client",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--url", default="localhost:8001", help="tritonserver gRPC address")
    p.add_argument("--model-name", default="tensorrt_llm")
    p.add_argument("--text", default="Born in north-east France, Soyer trained as a")
    p.add_argument("--max-tokens", type=int, default=16, help="request_output_len")
    p.add_argument("--streaming", action="store_true")
    p.add_argument("--model", default="default", help="the served model, for its tokenizer")
    p.add_argument("--tokenizer-dir", default=None, help="instead of --model's tokenizer")
    p.add_argument("--end-id", type=int, default=None, help="default: the tokenizer's eos id")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    if args.tokenizer_dir is None:
        from backend.loading.model_paths import resolve_model  # only without --tokenizer-dir

        args.tokenizer_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(args.tokenizer_dir)
    ids = encode(tokenizer, args.text)
    end_id = default_end_id(tokenizer) if args.end_id is None else args.end_id
    inputs = request_inputs(ids, args.max_tokens, end_id, default_pad_id(tokenizer), args.streaming)
    if not args.json:
        print(f"input ids ({len(ids)}): {ids}")
    show = None if args.json or not args.streaming else (lambda new: print(f"+ {new}", flush=True))
    try:
        output = generate(args.url, args.model_name, inputs, on_ids=show)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = tokenizer.decode(output, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"input_ids": ids, "output_ids": output, "text": text}))
    else:
        print(f"output ids ({len(output)}): {output}")
        print(f"text: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
