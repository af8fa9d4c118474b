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

    from backend.model_paths import resolve_model

    text = quality_corpus.CORPUS.read_text()
    assert "Django Software Foundation" in quality_corpus.LICENSE.read_text()
    paragraphs = text.split("\n\n")
    assert len(paragraphs) > 500 and not any(p.startswith((" ", "..", ">>>")) for p in paragraphs)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    assert 50_000 <= len(tokenizer.encode(text, add_special_tokens=False)) < 60_000
