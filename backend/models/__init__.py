"""Model families, by Hugging Face `model_type` (docs/model-families.md)."""

from backend.models.gemma import Gemma2ForCausalLM
from backend.models.llama import LlamaForCausalLM

FAMILIES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma": LlamaForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma2ForCausalLM,
}
