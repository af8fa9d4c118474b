"""Commands that make quantized checkpoints (`python -m backend.tools.awq_calibration`,
`python -m backend.tools.gptq_calibration`) and the calibration inputs they share."""
