"""Log-probs of tokens, and OpenAI's two shapes for them: the legacy one of /v1/completions
(`tokens`, `token_logprobs`, `top_logprobs` as token -> log-prob dicts, `text_offset`) and the
chat one (`content: [{token, logprob, bytes, top_logprobs}]`).

A token's text is its decode after another token (special tokens spelled out); a token that
carries part of a UTF-8 character reads as U+FFFD, as in other servers, and its chat `bytes` are
the bytes it carries, so that a client joining the bytes gets the text back. Log-probs the engine
reports as unknown (the first prompt token has no context) are null.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from postprocessing.detokenizer import token_bytes
from preprocessing.tokenizer import encode


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)  # best first


def tokens_of(ids, log_probs, top_ids=None, top_log_probs=None) -> list[TokenLogprob]:
    out = []
    for i, (token, value) in enumerate(zip(ids, log_probs)):
        top = list(zip(top_ids[i], top_log_probs[i])) if top_ids else []
        out.append(TokenLogprob(int(token), float(value), [(int(t), float(v)) for t, v in top]))
    return out


def prompt_tokens_of(ids, log_probs, top_ids=None, top_log_probs=None) -> list[TokenLogprob]:
    """The prompt's tokens; the first has no log-prob (the engine reports 0.0 there)."""
    tokens = tokens_of(ids, log_probs, top_ids, top_log_probs)
    if tokens:
        tokens[0].logprob, tokens[0].top = None, []
    return tokens


class Formatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        anchor = encode(tokenizer, "a", add_special_tokens=False)
        self._anchor = anchor[:1]
        self._anchor_text = self._decode(self._anchor)

    def text(self, token_id: int) -> str:
        """The token's text as it reads after another token: SentencePiece decoders drop the
        space of a "▁word" token that starts a sequence, so it is decoded after an anchor."""
        if token_id not in self._texts:
            text = self._decode([*self._anchor, token_id])
            if self._anchor and text.startswith(self._anchor_text):
                text = text[len(self._anchor_text) :]
            else:
                text = self._decode([token_id])
            self._texts[token_id] = text
        return self._texts[token_id]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def legacy(self, tokens: list[TokenLogprob], num_top: int, offset: int = 0) -> dict:
        """/v1/completions `logprobs`; text offsets start at `offset` characters."""
        texts = [self.text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [self._legacy_top(t, num_top) for t in tokens],
            "text_offset": offsets,
        }

    def _legacy_top(self, token: TokenLogprob, num_top: int) -> dict | None:
        if token.logprob is None:
            return None
        top = {self.text(t): v for t, v in token.top[:num_top]}
        top.setdefault(self.text(token.token_id), token.logprob)  # the chosen token, always
        return top

    def chat(self, tokens: list[TokenLogprob], num_top: int) -> list[dict]:
        """/v1/chat/completions `logprobs.content`."""
        return [
            {
                **self._chat_entry(t.token_id, t.logprob),
                "top_logprobs": [self._chat_entry(i, v) for i, v in t.top[:num_top]],
            }
            for t in tokens
        ]

    def bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        data = token_bytes(self.tokenizer, token_id) if "\ufffd" in text else None
        return list(text.encode("utf-8") if data is None else data)

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": self.bytes(token_id)}
