"""LoRA adapters on the base model: Hugging Face PEFT directories read and checked against the
model (`peft_adapter`), their weights held in per-layer slots (`linear_lora`), the rows of a step
grouped by adapter (`lora_batch`), and the adapters a runner serves by name (`manager`)."""
