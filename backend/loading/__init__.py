"""Loading a model: paths and presets, the on-disk cache, weight formats and quantized checkpoints,
GGUF conversion and weights."""
