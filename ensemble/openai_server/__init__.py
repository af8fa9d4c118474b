"""An OpenAI-compatible HTTP front end beside the Triton endpoints.

  python -m ensemble.openai_server --triton-url localhost:8001 --port 9000 --model default

It serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics, and talks to
the running tritonserver: each choice is one streamed gRPC request to the `tensorrt_llm` model
with token ids. Prompts are tokenized with the repository's `preprocessing` package (chat template
included) and outputs detokenized with `postprocessing`'s incremental detokenizer, so its text is
the text the ensemble returns. One engine, one queue and one set of metrics serve both front ends.

Modules: protocol (request bodies), errors (OpenAI's error shape, Triton errors mapped to HTTP
statuses), served_model (tokenizer and name), engine_request (request -> tensorrt_llm inputs),
triton_llm (the gRPC client), stop_strings, generation (one choice: ids -> text, stops,
log-probs), logprobs (OpenAI's two log-prob shapes), sse, context (what handlers share),
completions, chat, app, process (the child process `python -m ensemble serve` starts).
"""
