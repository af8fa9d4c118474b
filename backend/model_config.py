"""The model's shape and numerics, read from a Hugging Face `config.json`.

Only the Llama family is supported: `llama` (Llama 2/3, SmolLM), `mistral` and `qwen2`; `null`
is the model that computes nothing (backend/models/null.py).
RoPE settings are read from transformers 5's `rope_parameters` or from the older
`rope_theta` + `rope_scaling` pair.

Sliding-window attention: `layer_windows[i]` is layer i's attention window (a query sees the
last `window` tokens, itself included), None for global attention. Mistral (and Qwen2 with
`use_sliding_window`) gets `sliding_window` on every layer, or on the layers that transformers'
`layer_types` marks "sliding_attention"; the engine parameter
`max_attention_window_size` may override the windows (`with_attention_windows`), and
`sink_token_length` keeps the first tokens visible to windowed layers as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "null")
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, dynamic, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, or Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    sliding_window: int | None = None  # Mistral
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer: the attention window in tokens, or None (global); default: sliding_window.
    layer_windows: list[int | None] = field(default_factory=list)
    # Windowed layers also see the first sink_token_length tokens (StreamingLLM attention sinks).
    sink_token_length: int = 0

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [self.sliding_window] * self.num_layers

    @property
    def attention_window(self) -> int | None:
        """The most recent tokens any layer's query sees (its window less the sinks), or None
        when some layer attends globally: older blocks, past the sinks, are read by no layer."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows) - self.sink_token_length

    @property
    def max_context(self) -> int:
        """Longest sequence this engine computes (windows are honoured, positions kept)."""
        return self.max_position_embeddings

    def with_attention_windows(
        self, windows: tuple[int, ...] | None, sink_token_length: int = 0
    ) -> "ModelConfig":
        """A copy with the engine's windows: a list applied as a repeating per-layer pattern
        (one entry = every layer), None = the model's own; and its sink tokens."""
        layer_windows = list(self.layer_windows)
        if windows:
            layer_windows = [windows[i % len(windows)] for i in range(self.num_layers)]
        for i, window in enumerate(layer_windows):
            if window is not None and sink_token_length >= window:
                raise ValueError(
                    f"sink_token_length must be less than the attention window, got "
                    f"{sink_token_length} for layer {i}'s window of {window}"
                )
        return replace(self, layer_windows=layer_windows, sink_token_length=sink_token_length)

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: this engine runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: expected 'silu'")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True")
        num_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding_window = None
        if model_type == "mistral" or (model_type == "qwen2" and cfg.get("use_sliding_window")):
            sliding_window = cfg.get("sliding_window")
        layer_windows = []  # transformers 5 names each layer's kind (Qwen2: max_window_layers)
        if sliding_window is not None and cfg.get("layer_types"):
            layer_windows = [
                sliding_window if kind == "sliding_attention" else None
                for kind in cfg["layer_types"]
            ]
        elif sliding_window is not None and model_type == "qwen2":  # older configs
            first = cfg.get("max_window_layers", 0)
            layer_windows = [
                sliding_window if i >= first else None for i in range(cfg["num_hidden_layers"])
            ]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_config(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            sliding_window=sliding_window,
            layer_windows=layer_windows,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
        )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope_config(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
    params.update(cfg.get("rope_scaling") or {})  # older configs
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}: expected one of {ROPE_TYPES}")
    original = params.get("original_max_position_embeddings")
    if rope_type == "llama3" and original is None:
        original = cfg.get("max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
    )
