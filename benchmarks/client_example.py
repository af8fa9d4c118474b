"""A tritonclient gRPC streaming client, written exactly as one for TensorRT-LLM's backend would be.

python -m benchmarks.client_example --url localhost:8001 --prompt "Write a haiku about the sea."

The prompt goes in the model's chat template (the ensemble's `apply_chat_template` input) when
the model has one: an instruct model answers a bare request poorly. A model without a template
refuses that input, and the prompt is then sent as plain text to continue; --plain always does.
"""

from __future__ import annotations

import argparse
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

NO_TEMPLATE = "has no chat template"  # in preprocessing's refusal of apply_chat_template


def as_input(name: str, value: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    tensor.set_data_from_numpy(value)
    return tensor


def stream(url: str, inputs: list[grpcclient.InferInput]) -> str | None:
    """Print the streamed text as it comes; the error, if the request failed."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("ensemble", inputs, request_id="1", enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                return str(error)
            final = result.get_response().parameters.get("triton_final_response")
            text = result.as_numpy("text_output")
            if text is not None and text.size:
                print(text.reshape(-1)[0].decode(), end="", flush=True)
            if final is not None and final.bool_param:
                return None
    finally:
        client.stop_stream()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--prompt", default="Write a haiku about the sea.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--plain", action="store_true", help="never apply the chat template")
    args = p.parse_args(argv)

    inputs = [
        as_input("text_input", np.array([[args.prompt.encode()]], dtype=object)),
        as_input("max_tokens", np.array([[args.max_tokens]], dtype=np.int32)),
        as_input("stream", np.array([[True]], dtype=bool)),
        as_input("temperature", np.array([[args.temperature]], dtype=np.float32)),
    ]
    chat = [as_input("apply_chat_template", np.array([[True]], dtype=bool))]
    error = NO_TEMPLATE if args.plain else stream(args.url, inputs + chat)
    if error is not None and NO_TEMPLATE in error:
        error = stream(args.url, inputs)  # a model without a chat template: continue the text
    print()
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
