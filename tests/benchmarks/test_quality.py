"""benchmarks/quality.py: the sliding windows score every corpus token after the first exactly
once, with at most window - stride tokens of context lost at each window start; the agreement
measures; the committed corpus is what its provenance says (prose, over 50k tokens)."""

from __future__ import annotations

import pytest

from benchmarks import quality_corpus
from benchmarks.quality import agreement, windows


@pytest.mark.parametrize("n,window,stride", [(2000, 512, 256), (512, 512, 256), (700, 100, 30)])
def test_windows_score_each_token_once(n, window, stride):
    spans = windows(n, window, stride)
    scored = [p for start, end, first in spans for p in range(first, end)]
    assert scored == list(range(1, n))
    for start, end, first in spans:
        assert end - start <= window and start <= first
        assert first == 1 or first - start >= window - stride  # context for every scored token


def test_agreement_measures():
    reference = [[1, 2, 3, 4], [5, 6], [7], []]  # [] : the end id came first
    assert agreement(reference, reference) == {"exact_sequences": 1.0, "prefix_agreement": 1.0}
    got = agreement([[1, 2, 9, 9], [5, 6, 7], [8], [3]], reference)
    assert got["exact_sequences"] == 0.0
    assert got["prefix_agreement"] == pytest.approx((2 / 4 + 2 / 3 + 0 + 0) / 4)


def test_the_corpus_is_english_prose_of_the_stated_size():
    from transformers import AutoTokenizer

    from backend.loading.model_paths import resolve_model

    text = quality_corpus.CORPUS.read_text()
    assert "Django Software Foundation" in quality_corpus.LICENSE.read_text()
    paragraphs = text.split("\n\n")
    assert len(paragraphs) > 500 and not any(p.startswith((" ", "..", ">>>")) for p in paragraphs)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    assert 50_000 <= len(tokenizer.encode(text, add_special_tokens=False)) < 60_000


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q5_0", "Q4_0"])
def test_requantized_gguf_holds_the_default_model_in_the_new_blocks(quant_type):
    """Each block tensor of the shipped GGUF is re-quantized (the norms copied), and de-quantizes
    to the original values within the new type's rounding: half a step (Q8_0: amax / 127), or a
    whole one where Q4_0 / Q5_0 clip the end opposite the signed max (d = max / -8, -16), plus
    the float16 rounding of d."""
    gguf = pytest.importorskip("gguf")

    from backend.loading.model_paths import default_gguf_path
    from benchmarks.gguf_requantize import requantized_gguf

    source = {t.name: t for t in gguf.GGUFReader(default_gguf_path()).tensors}
    written = {t.name: t for t in gguf.GGUFReader(requantized_gguf(quant_type)).tensors}
    assert written.keys() == source.keys()
    for name, tensor in written.items():
        old = source[name]
        if old.tensor_type.name in ("F32", "F16"):
            assert tensor.tensor_type == old.tensor_type and (tensor.data == old.data).all()
            continue
        assert tensor.tensor_type.name == quant_type
        before = gguf.quants.dequantize(old.data, old.tensor_type)
        after = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert after.shape == before.shape
        step = (
            abs(before.reshape(-1, 32)).max(axis=1)
            / {"Q8_0": 127, "Q5_0": 16, "Q4_0": 8}[quant_type]
        )
        error = abs(after - before).reshape(-1, 32).max(axis=1)
        assert (error <= step * (0.56 if quant_type == "Q8_0" else 1.01) + 1e-6).all(), name
