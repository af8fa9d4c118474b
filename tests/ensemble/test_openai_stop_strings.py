"""OpenAI stop strings on streamed text (ensemble/openai_server/stop_strings.py): however the
text is split into deltas, the released text is the text before the first stop string, and no
delta shows the beginning of a stop string that later completes."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from ensemble.openai_server.stop_strings import StopStrings

ALPHABET = "ab \n"


def expected(text: str, stops: list[str]) -> tuple[str, bool]:
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


@example(text="aaba", stops=["b", "aba"], splits=[3])  # "aba" begins first, completes last
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    splits=st.lists(st.integers(0, 40), max_size=8),
)
def test_released_text_ends_before_the_first_stop_however_it_is_split(text, stops, splits):
    matcher = StopStrings(stops)
    bounds = sorted({0, len(text), *(min(s, len(text)) for s in splits)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    released = ""
    for i, piece in enumerate(pieces):
        delta = matcher.feed(piece, final=i == len(pieces) - 1)
        released += delta
        want, _ = expected(text, stops)
        assert want.startswith(released)  # never more than the final text, at any point
    assert (released, matcher.matched) == expected(text, stops)


def test_a_partial_stop_string_is_held_back_until_it_is_decided():
    matcher = StopStrings(["</s>"])
    assert matcher.feed("Hello </") == "Hello "
    assert matcher.feed("b>") == "</b>"
    assert matcher.feed(" bye </") == " bye "
    assert matcher.feed("s> more") == "" and matcher.matched
    assert matcher.feed("ignored") == ""


def test_without_stop_strings_text_passes_through():
    matcher = StopStrings([])
    assert matcher.feed("abc") == "abc" and not matcher.matched
