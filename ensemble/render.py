"""Render every config.pbtxt of the model repository from one `ServeSettings`.

The output is plain text with real values (no `${...}` placeholders). Unset engine values are
written as "auto", which the models read back as "let the engine decide".
"""

from __future__ import annotations

from ensemble.settings import ServeSettings, to_param
from ensemble.tensors import BLS, ENSEMBLE, POSTPROCESSING, PREPROCESSING, TENSORRT_LLM, Tensor

HEADER = (
    "# Rendered by `python -m ensemble build` from ensemble/settings.py; "
    "change the settings, not this file.\n"
)

MODEL_NAMES = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")


def render_configs(settings: ServeSettings) -> dict[str, str]:
    """Model name -> config.pbtxt text."""
    settings.validate()
    return {
        "ensemble": render_ensemble(settings),
        "preprocessing": render_preprocessing(settings),
        "tensorrt_llm": render_tensorrt_llm(settings),
        "postprocessing": render_postprocessing(settings),
        "tensorrt_llm_bls": render_bls(settings),
    }


def render_ensemble(s: ServeSettings) -> str:
    lines = [
        'name: "ensemble"',
        'platform: "ensemble"',
        f"max_batch_size: {s.triton_max_batch_size}",
    ]
    lines += _tensors("input", ENSEMBLE.inputs) + _tensors("output", ENSEMBLE.outputs)
    lines.append("ensemble_scheduling {")
    lines.append("  step [")
    for i, step in enumerate(ENSEMBLE.steps):
        lines.append("    {")
        lines.append(f'      model_name: "{step.model}"')
        lines.append("      model_version: -1")
        for key, value in step.inputs.items():
            lines.append(f'      input_map {{ key: "{key}" value: "{value}" }}')
        for key, value in step.outputs.items():
            lines.append(f'      output_map {{ key: "{key}" value: "{value}" }}')
        lines.append("    }" + ("," if i < len(ENSEMBLE.steps) - 1 else ""))
    lines += ["  ]", "}"]
    return _text(lines)


def render_preprocessing(s: ServeSettings) -> str:
    lines = _python_model("preprocessing", s.triton_max_batch_size)
    lines += _tensors("input", PREPROCESSING.inputs) + _tensors("output", PREPROCESSING.outputs)
    lines += _dynamic_batching(s.max_queue_delay_microseconds)
    lines += _instances(s.preprocessing_instance_count)
    lines += _parameters(
        {
            "model_path": s.model_path,
            "quantization": s.quantization,  # which cached directory holds the tokenizer
            "tokenizer_dir": s.tokenizer_dir,
            "add_special_tokens": s.add_special_tokens,
            "default_max_tokens": s.default_max_tokens,
            "apply_chat_template": s.apply_chat_template,
        }
    )
    return _text(lines)


def render_tensorrt_llm(s: ServeSettings) -> str:
    lines = _python_model("tensorrt_llm", s.triton_max_batch_size)
    lines += _transaction_policy(s.decoupled_mode)
    lines += _tensors("input", TENSORRT_LLM.inputs) + _tensors("output", TENSORRT_LLM.outputs)
    lines += _dynamic_batching(s.max_queue_delay_microseconds)
    lines += _instances(s.llm_instance_count)  # one engine for all: it owns the KV cache
    params = dict(s.engine_parameters())
    params.update(
        {
            "exclude_input_in_output": s.exclude_input_in_output,
            "default_max_tokens": s.default_max_tokens,
            "cancellation_check_period_ms": s.cancellation_check_period_ms,
            "stats_check_period_ms": s.stats_check_period_ms,
            "response_rate_limit": s.response_rate_limit,
        }
    )
    lines += _parameters(params)
    return _text(lines)


def render_postprocessing(s: ServeSettings) -> str:
    # Each streamed piece of a request is a request here: batching them (ragged windows) makes
    # one execute of many; preserve_ordering keeps a request's pieces in order.
    lines = _python_model("postprocessing", s.triton_max_batch_size)
    lines += _tensors("input", POSTPROCESSING.inputs) + _tensors("output", POSTPROCESSING.outputs)
    if s.postprocessing_batching:
        lines += _dynamic_batching(0, preserve_ordering=True)
    lines += _instances(s.postprocessing_instance_count if s.postprocessing_batching else 1)
    lines += _parameters(
        {
            "model_path": s.model_path,
            "quantization": s.quantization,  # which cached directory holds the tokenizer
            "tokenizer_dir": s.tokenizer_dir,
            "skip_special_tokens": s.skip_special_tokens,
        }
    )
    return _text(lines)


def render_bls(s: ServeSettings) -> str:
    lines = _python_model("tensorrt_llm_bls", s.triton_max_batch_size)
    lines += _transaction_policy(s.decoupled_mode)
    lines += _tensors("input", BLS.inputs) + _tensors("output", BLS.outputs)
    lines += _instances(s.bls_instance_count)
    lines += _parameters({"tensorrt_llm_model_name": "tensorrt_llm"})
    return _text(lines)


# ---- pbtxt pieces --------------------------------------------------------------------------------
def _python_model(name: str, max_batch_size: int) -> list[str]:
    return [f'name: "{name}"', 'backend: "python"', f"max_batch_size: {max_batch_size}"]


def _transaction_policy(decoupled: bool) -> list[str]:
    # The ensemble has no policy of its own: Triton makes it decoupled when a step is.
    return ["model_transaction_policy {", f"  decoupled: {to_param(decoupled)}", "}"]


def _tensors(kind: str, tensors: tuple[Tensor, ...]) -> list[str]:
    lines = [f"{kind} ["]
    for i, t in enumerate(tensors):
        dims = ", ".join(str(d) for d in t.dims)
        lines += [
            "  {",
            f'    name: "{t.name}"',
            f"    data_type: TYPE_{t.dtype}",
            f"    dims: [ {dims} ]",
        ]
        if t.optional:
            lines.append("    optional: true")
        if t.ragged:
            lines.append("    allow_ragged_batch: true")
        lines.append("  }" + ("," if i < len(tensors) - 1 else ""))
    lines.append("]")
    return lines


def _dynamic_batching(delay_us: int, preserve_ordering: bool = False) -> list[str]:
    order = ["  preserve_ordering: true"] if preserve_ordering else []
    return ["dynamic_batching {", f"  max_queue_delay_microseconds: {delay_us}", *order, "}"]


def _instances(count: int) -> list[str]:
    return ["instance_group [", "  {", f"    count: {count}", "    kind: KIND_CPU", "  }", "]"]


def _parameters(values: dict) -> list[str]:
    lines = []
    for key, value in values.items():
        text = to_param(value).replace("\\", "\\\\").replace('"', '\\"')
        lines += ["parameters {", f'  key: "{key}"', f'  value: {{ string_value: "{text}" }}', "}"]
    return lines


def _text(lines: list[str]) -> str:
    return HEADER + "\n".join(lines) + "\n"
