"""The model's shape and numerics, read from a Hugging Face `config.json`.

The families in `backend.models.FAMILIES` (`SUPPORTED_MODEL_TYPES`); `null` is the model that
computes nothing (backend/models/null.py). What sets one family apart from Llama is a field here
(QK-norm, GeGLU, Gemma's (1 + w) norms, soft-capping, per-layer windows and rotary bases, fused
checkpoint projections), read by the shared layers in `backend.layers`.
RoPE settings are read from transformers 5's `rope_parameters` (per layer type for Gemma 3) or
from the older `rope_theta` + `rope_scaling` pair.

Sliding-window attention: `layer_windows[i]` is layer i's attention window (a query sees the
last `window` tokens, itself included), None for global attention. Mistral (and Qwen2 with
`use_sliding_window`) gets `sliding_window` on every layer, or on the layers that transformers'
`layer_types` marks "sliding_attention"; the engine parameter
`max_attention_window_size` may override the windows (`with_attention_windows`), and
`sink_token_length` keeps the first tokens visible to windowed layers as well.

KV cache groups (`kv_cache_groups`): layers whose cache blocks share one block table. A model
that mixes global and windowed layers (Gemma 2/3) gets two, so the windowed layers' blocks past
their window can go back to their own pool while the global layers keep every block.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "null",
)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # Hugging Face name -> ours
ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear, dynamic, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3


@dataclass(frozen=True)
class LayerGroup:
    """Layers whose KV cache blocks one block table addresses (`ModelConfig.kv_cache_groups`)."""

    window: int | None  # the most recent tokens their queries see, less the sinks; None: global
    layers: tuple[int, ...]


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
    sliding_window: int | None = None  # the window of the layers that have one
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before rotary
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), in float32
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # Gemma 2/3: query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    local_rope: RopeConfig | None = None  # Gemma 3: the rotary of sliding-window layers
    fused_checkpoint: bool = False  # Phi-3: checkpoints hold qkv_proj and gate_up_proj fused
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
    def kv_cache_groups(self) -> list[LayerGroup]:
        """One group when every layer attends globally or every layer has a window (their
        largest, as `attention_window`); else the global layers, then the windowed ones (their
        largest window)."""
        windowed = tuple(i for i, w in enumerate(self.layer_windows) if w is not None)
        every = tuple(range(self.num_layers))
        if len(windowed) in (0, self.num_layers):
            return [LayerGroup(self.attention_window, every)]
        widest = max(w for w in self.layer_windows if w is not None)
        return [
            LayerGroup(None, tuple(i for i in every if i not in windowed)),
            LayerGroup(widest - self.sink_token_length, windowed),
        ]

    def kv_cache_group_of(self, layer: int) -> int:
        """The index in `kv_cache_groups` of the group holding `layer`."""
        return next(g for g, group in enumerate(self.kv_cache_groups) if layer in group.layers)

    @property
    def max_context(self) -> int:
        """Longest sequence this engine computes (windows are honoured, positions kept)."""
        return self.max_position_embeddings

    def pick_max_seq_len(self, requested: int | None) -> int:
        """The engine's `max_seq_len` (None: the model's limit); ValueError past its positions."""
        if requested is None:  # decode steps cost what their contexts hold, not the capacity
            return self.max_context
        if requested > self.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {requested} exceeds the model's "
                f"max_position_embeddings {self.max_position_embeddings}"
            )
        return min(requested, self.max_context)

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
        gemma = model_type.startswith("gemma")
        act_key = "hidden_activation" if model_type in ("gemma2", "gemma3_text") else "hidden_act"
        hidden_act = cfg.get(act_key) or "silu"
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported {act_key} {hidden_act!r}: expected one of {tuple(ACTIVATIONS)}"
            )
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True")
        partial_rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
        if cfg.get("partial_rotary_factor", partial_rotary or 1.0) != 1.0:
            raise ValueError("unsupported partial_rotary_factor: only 1.0 (full rotary)")
        num_heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        windows = _layer_windows(cfg)
        rope, local_rope = _rope_configs(cfg)
        pre_attn_scalar = cfg.get("query_pre_attn_scalar")
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
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            sliding_window=next((w for w in windows if w is not None), None),
            layer_windows=windows,
            hidden_act=ACTIVATIONS[hidden_act],
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            norm_unit_offset=gemma,
            embedding_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            attn_scale=pre_attn_scalar**-0.5 if pre_attn_scalar and gemma else None,
            attn_logit_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            local_rope=local_rope,
            fused_checkpoint=model_type == "phi3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
        )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _layer_windows(cfg: dict) -> list[int | None]:
    """Each layer's attention window (None: global). Layers typed "sliding_attention" have one
    (Gemma 2/3, Qwen); without types every layer has the configured one (Mistral, Phi-3)."""
    model_type, window = cfg["model_type"], cfg.get("sliding_window")
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window"):
        window = None
    if model_type == "gemma":
        window = None
    layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types") or _default_layer_types(cfg, layers)
    if layer_types is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def _default_layer_types(cfg: dict, layers: int) -> list[str] | None:
    """Layer types as transformers derives them for configs written without `layer_types`."""
    model_type = cfg["model_type"]
    if model_type.startswith("qwen"):
        first = cfg.get("max_window_layers", 28)  # transformers' Qwen default
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    pattern = {"gemma2": 2, "gemma3_text": cfg.get("sliding_window_pattern", 6)}.get(model_type)
    if pattern is None:
        return None
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]


def _rope_configs(cfg: dict) -> tuple[RopeConfig, RopeConfig | None]:
    """The rotary of global layers, and of sliding-window layers where it differs (Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    if cfg["model_type"] != "gemma3_text":
        return _rope_config(cfg, params), None
    if "full_attention" in params:  # transformers >= 5: one set per layer type
        return (
            _rope_config(cfg, params["full_attention"]),
            _rope_config(cfg, params["sliding_attention"]),
        )
    local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return _rope_config({"rope_theta": 1_000_000.0, **cfg}, params), local


def _rope_config(cfg: dict, params: dict) -> RopeConfig:
    params = dict(params)  # transformers >= 5
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
