"""OpenAI's log-prob shapes (ensemble/openai_server/logprobs.py) on real tokenizers: the chat
shape's `bytes` join back to the text also where a token carries part of a character, and the
legacy shape's offsets follow the tokens' texts."""

from __future__ import annotations

from ensemble.openai_server.logprobs import Formatter, TokenLogprob, prompt_tokens_of
from preprocessing.tokenizer import encode

TEXT = "Ça va? 日本 est très loin."


def _tokens(tokenizer) -> list[TokenLogprob]:
    ids = encode(tokenizer, TEXT, add_special_tokens=False)
    return [TokenLogprob(i, -1.0, [(i, -1.0)]) for i in ids]


def test_chat_bytes_join_to_the_text_with_partial_characters(smollm2, sentencepiece):
    for tokenizer in (smollm2, sentencepiece):
        tokens = _tokens(tokenizer)
        entries = Formatter(tokenizer).chat(tokens, 1)
        assert any("\ufffd" in e["token"] for e in entries)  # the case this test is for
        joined = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8")
        assert joined.strip() == TEXT
        assert [t["bytes"] for e in entries for t in e["top_logprobs"]] == [
            e["bytes"] for e in entries
        ]


def test_legacy_shape_with_a_prompt(smollm2):
    ids = encode(smollm2, "Hello world", add_special_tokens=False)
    tokens = prompt_tokens_of(ids, [0.0, -2.5], [[], [ids[1]]], [[], [-2.5]])
    legacy = Formatter(smollm2).legacy(tokens, 1)
    assert legacy["tokens"] == ["Hello", " world"]
    assert legacy["token_logprobs"] == [None, -2.5]
    assert legacy["top_logprobs"] == [None, {" world": -2.5}]
    assert legacy["text_offset"] == [0, 5]
