"""The default GGUF with its quantized tensors re-quantized to another block type, for the quality
benchmark's per-type rows (`quality.py`, `gguf_q8_0` ...).

Every tensor the shipped file stores in blocks (Q4_1, its embedding Q8_0) is de-quantized and
quantized again by the gguf package (`gguf.quants`), which implements the quantizers of Q8_0,
Q4_0, Q4_1 and Q5_0 (not the K-quants); float tensors (the norms) and all metadata are copied
as they are. The values so start from the Q4_1 model's, the `none` row, and take a second
rounding onto the new grid. Written once into the cache.
"""

from __future__ import annotations

import os

from backend.loading.disk_cache import cache_root
from backend.loading.model_paths import default_gguf_path

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")  # what gguf.quants can write


def requantized_gguf(quant_type: str) -> str:
    """Path of the default model's GGUF with its block tensors in `quant_type` (cached)."""
    if quant_type not in QUANTIZABLE:
        raise ValueError(f"quant_type must be one of {QUANTIZABLE}, got {quant_type!r}")
    source = default_gguf_path()
    stem = os.path.basename(source).rsplit(".", 2)[0]
    out = os.path.join(cache_root(), f"{stem}.requantized-{quant_type}.gguf")
    if not os.path.isfile(out):
        _write(source, out + ".partial", quant_type)
        os.replace(out + ".partial", out)
    return out


def _write(source: str, out: str, quant_type: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    architecture = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer sets these
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    target = gguf.GGMLQuantizationType[quant_type]
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        if tensor.tensor_type in floats:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        blocks = gguf.quants.quantize(values, target)
        writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
