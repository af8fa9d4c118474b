"""Random-weight PEFT LoRA adapters saved as Hugging Face adapter directories, and the
transformers + PEFT model of each (the ground truth the engine must match)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base_dir, adapter_dir, seed: int, std: float, **lora_config):
    """A LoRA adapter of `lora_config` (peft.LoraConfig fields) on the model in `base_dir`, its A
    and B drawn from N(0, std) (PEFT would start B at zero: no effect), saved to `adapter_dir`.
    Returns the transformers model with the adapter applied, in eval mode."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(adapter_dir)
    return model.eval()
