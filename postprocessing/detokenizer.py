"""Exact incremental detokenization under a stateless contract.

In the Triton ensemble every response of the LLM step becomes an independent request to the
postprocessing step, which can read only what the LLM sent. So the LLM side keeps, per request,
``num_sent`` (generated ids already sent) and sends with every response

    window_ids  = ids[window_start(num_sent):]      # a few already-sent ids, then the new ones
    num_context = num_sent - window_start(num_sent)  # how many of window_ids were sent before
    final       = whether this is the request's last response

and the postprocessing step returns ``text_delta(tokenizer, window_ids, num_context, final)``.
A non-streamed response is the same call over all ids with ``num_context=0, final=True``.

The delta. ``emitted(k)`` is the text the client holds once the first ``k`` window ids are sent:
the decode of ``window[o:k]`` without the trailing tokens that carry an incomplete UTF-8
character (held back until the character is complete). The delta is ``decode(window[o:])``
(final) or ``emitted(len(window))`` (not final), minus ``emitted(num_context)``. ``o`` skips
byte-fallback continuation tokens (``<0x80>``..``<0xBF>``) at the start of the window: they
belong to a character sent earlier, and a SentencePiece byte-fallback decoder turns a whole run
of byte tokens into U+FFFD when the run starts inside a character.

Finding the incomplete character. For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) and
SentencePiece with byte fallback (Llama 2, Mistral, Gemma) the bytes of each token are known
(the GPT-2 byte alphabet, ``<0xHH>`` tokens), so the held tokens are found exactly: the last
lead byte among the last few bytes with fewer continuation bytes after it than it needs. For
other tokenizers the decode is cut back to the last of the final MAX_HELD_TOKENS + 1 token
boundaries whose text does not end in U+FFFD, or loses one trailing U+FFFD.

Why the deltas concatenate to ``decode(all ids)``. They telescope: each step subtracts exactly
what the previous step added, provided both compute the same ``emitted(num_sent)`` from their
different windows. They do, because what is held back depends only on the last few ids (a UTF-8
character has at most 4 bytes, so an incomplete one spans at most 3 byte-carrying tokens), and a
decode that starts a few tokens earlier agrees with the full decode after the first 3 bytes (a
byte that is not a continuation byte starts a character in every decoder); a cut before a lead
byte never changes the text before it. Eight context tokens that carry text cover the skipped
start (<= 3), the held tail (<= 3, looked for among the last 5 tokens that carry text; skipped
special tokens between them are passed over) and give the first new token its leading space.
Skipped special tokens carry no text, so the window holds DETOKENIZE_CONTEXT = 16 ids: the
deltas are exact while at most 8 of the 16 ids before each response's new ones are skipped
special tokens (or the window starts at the first id). This holds for byte-level BPE for any id
stream, and for byte fallback for streams whose byte runs are valid UTF-8 (anything a tokenizer
produces from text, U+FFFD included). A byte fallback run that is not valid UTF-8 decodes to
U+FFFD as a whole, so text that was already streamed changes afterwards; no streaming detokenizer
can be exact there.

Fallback. Cleanup rules (``clean_up_tokenization_spaces``: " ." -> ".") can make the previous
text not a prefix of the current one. Then the delta is the current text after the longest common
prefix of the two: text the client already holds is never repeated and nothing new is dropped,
but a character the cleanup removed afterwards stays in the stream (e.g. "a ." for "a.").
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

DETOKENIZE_CONTEXT = 16
MAX_HELD_TOKENS = 3
_MAX_SKIPPED_TOKENS = 3
_TEXT_CONTEXT = 8  # context tokens that carry text the argument below needs
_TAIL_TOKENS = _TEXT_CONTEXT - _MAX_SKIPPED_TOKENS
_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")


def window_start(num_sent: int) -> int:
    """Index of the first id the LLM side sends, given how many it has sent already."""
    if num_sent < 0:
        raise ValueError(f"num_sent must be >= 0, got {num_sent}")
    return max(0, num_sent - DETOKENIZE_CONTEXT)


def text_delta(
    tokenizer,
    window_ids: Sequence[int],
    num_context: int,
    final: bool,
    skip_special_tokens: bool = True,
) -> str:
    """The text that the ids after ``window_ids[:num_context]`` add to the stream."""
    ids = [int(i) for i in window_ids]
    if not 0 <= num_context <= len(ids):
        raise ValueError(
            f"num_context must be in [0, {len(ids)}] (the window length), got {num_context}"
        )

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=skip_special_tokens)

    previous, current = decode(ids[:num_context]), decode(ids)
    if _REPLACEMENT not in previous and _REPLACEMENT not in current:
        return _difference(previous, current)  # nothing incomplete, nothing to skip

    tail = _TailFinder(tokenizer, decode, skip_special_tokens)
    start = tail.first_character_start(ids, num_context)
    previous = tail.emitted(ids, start, num_context)
    current = decode(ids[start:]) if final else tail.emitted(ids, start, len(ids))
    return _difference(previous, current)


class _TailFinder:
    """Finds where the text of a window may start and end without a broken character."""

    def __init__(self, tokenizer, decode: Callable[[list[int]], str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.decode = decode
        self.token_bytes = _token_bytes_reader(tokenizer)
        self.silent_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()

    def first_character_start(self, ids: list[int], num_context: int) -> int:
        """Skip byte-fallback continuation tokens (and skipped special tokens, which carry no
        text) at the start of the context.

        Only tokens spelled ``<0x80>``..``<0xBF>`` that decode to U+FFFD on their own are skipped,
        so a vocabulary entry for the literal text "<0x80>" never is.
        """
        tokens = self.tokenizer.convert_ids_to_tokens(ids[:num_context])
        start = skipped_bytes = 0
        while start < num_context:
            if ids[start] in self.silent_ids:
                start += 1
            elif (
                skipped_bytes < _MAX_SKIPPED_TOKENS
                and _is_continuation_byte_token(tokens[start])
                and self.decode(ids[start : start + 1]) == _REPLACEMENT
            ):
                start += 1
                skipped_bytes += 1
            else:
                break
        return start

    def emitted(self, ids: list[int], start: int, end: int) -> str:
        held = self.held_tokens(ids, start, end)
        if held is not None:
            return self.decode(ids[start : end - held])
        boundary = end
        for _ in range(MAX_HELD_TOKENS + 1):  # token boundaries, skipped special tokens apart
            while boundary > start and ids[boundary - 1] in self.silent_ids:
                boundary -= 1  # the same text as one token later
            text = self.decode(ids[start:boundary])
            if not text.endswith(_REPLACEMENT) or boundary == start:
                return text
            boundary -= 1
        text = self.decode(ids[start:end])
        return text[:-1] if text.endswith(_REPLACEMENT) else text

    def held_tokens(self, ids: list[int], start: int, end: int) -> Optional[int]:
        """How many last tokens of ids[start:end] carry an incomplete UTF-8 character.

        None when the bytes of this tokenizer's tokens are unknown.
        """
        if self.token_bytes is None:
            return None
        last_bytes: list[tuple[int, int]] = []  # (byte, token position), last byte first
        carrying = 0  # tokens looked at that carry text (skipped special tokens do not count)
        for position in range(end - 1, start - 1, -1):
            if ids[position] in self.silent_ids:
                continue
            data = self.token_bytes(self.tokenizer.convert_ids_to_tokens(ids[position]))
            if data is None:  # a token of complete characters that has no byte spelling
                break
            last_bytes.extend((byte, position) for byte in reversed(data))
            carrying += 1
            if len(last_bytes) >= 4 or carrying == _TAIL_TOKENS:
                break
        continuations = 0
        reach = min(3, len(last_bytes))
        while continuations < reach and 0x80 <= last_bytes[continuations][0] <= 0xBF:
            continuations += 1
        if continuations == len(last_bytes):
            return 0  # no lead byte in reach: nothing that later bytes could complete
        lead, position = last_bytes[continuations]
        return end - position if _utf8_length(lead) > continuations + 1 else 0


def _utf8_length(lead: int) -> int:
    if lead >= 0xF0:
        return 4
    if lead >= 0xE0:
        return 3
    if lead >= 0xC0:
        return 2
    return 1


def _is_continuation_byte_token(token) -> bool:
    match = _BYTE_TOKEN.fullmatch(token) if isinstance(token, str) else None
    return match is not None and 0x80 <= int(match.group(1), 16) <= 0xBF


def token_bytes(tokenizer, token_id: int) -> Optional[bytes]:
    """The UTF-8 bytes a token carries where its vocabulary spells them (byte-level BPE tokens,
    byte-fallback ``<0xHH>`` tokens), so also a part of a character; None where unknown."""
    reader = _token_bytes_reader(tokenizer)
    token = tokenizer.convert_ids_to_tokens(int(token_id))
    if reader is _byte_fallback_bytes and not _BYTE_TOKEN.fullmatch(str(token)):
        return None  # a piece with "▁" for spaces: its decode says it better
    return None if reader is None else reader(token)


def _token_bytes_reader(tokenizer) -> Optional[Callable[[str], Optional[bytes]]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = repr(getattr(backend, "decoder", None))
    if "ByteLevel" in decoder:
        return _byte_level_bytes
    if "ByteFallback" in decoder:
        return _byte_fallback_bytes
    return None


def _byte_fallback_bytes(token) -> Optional[bytes]:
    if not isinstance(token, str):
        return None
    match = _BYTE_TOKEN.fullmatch(token)
    return bytes([int(match.group(1), 16)]) if match else token.encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if chr(byte) not in alphabet]
    for offset, byte in enumerate(others):
        alphabet[chr(0x100 + offset)] = byte
    return alphabet


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _byte_level_bytes(token) -> Optional[bytes]:
    if not isinstance(token, str):
        return None
    try:
        return bytes(_BYTE_LEVEL_ALPHABET[char] for char in token)
    except KeyError:
        return None


def _special_ids(tokenizer) -> frozenset:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
    return frozenset(special | set(getattr(tokenizer, "all_special_ids", ())))


def _difference(previous: str, current: str) -> str:
    if current.startswith(previous):
        return current[len(previous) :]
    common = 0
    for a, b in zip(previous, current):
        if a != b:
            break
        common += 1
    return current[common:]
