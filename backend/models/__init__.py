"""Model families, by Hugging Face `model_type` (README: "Adding a model family")."""

from backend.models.llama import LlamaForCausalLM

FAMILIES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}
