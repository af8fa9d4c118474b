"""The streamed deltas of postprocessing.detokenizer concatenate to the one-shot decode."""

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from postprocessing.detokenizer import DETOKENIZE_CONTEXT, text_delta, window_start
from tests.tokenizer_fixtures import smollm2_tokenizer_dir

MULTIBYTE_TEXTS = [
    "Hello world 😀😀😀 🎉 日本語のテキスト café naïve Zürich crème brûlée",
    "中文文本，emoji 👩‍👩‍👧 and 🙂🙂🙂🙂🙂🙂 then ümlaut ß ø å",
    "Ελληνικά русский עברית العربية हिन्दी 한국어",
]
ALPHABET = "abc xyz,.!\n\té ü ß 日本語中文 😀🎉🙂👩‍👧 Ωж"
PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def stream(tokenizer, ids, cuts, skip_special_tokens=True):
    """The deltas the postprocessing step returns when the LLM sends ids[:cut] step by step.

    ``cuts`` are the id counts sent after each response; the last response is the final one
    (a repeated last cut is a final response that carries no new ids).
    """
    deltas, num_sent = [], 0
    for step, cut in enumerate(cuts):
        start = window_start(num_sent)
        final = step == len(cuts) - 1
        window, num_context = ids[start:cut], num_sent - start
        deltas.append(text_delta(tokenizer, window, num_context, final, skip_special_tokens))
        num_sent = cut
    return deltas


def within_contract(tokenizer, ids, cuts):
    """Whether every response's window holds at least 8 context ids that carry text (skipped
    special tokens carry none), or starts at the first id: where the deltas are exact."""
    special, num_sent = set(special_ids(tokenizer)), 0
    for cut in cuts:
        start = window_start(num_sent)
        if start > 0 and sum(i not in special for i in ids[start:num_sent]) < 8:
            return False
        num_sent = cut
    return True


@st.composite
def cuts_for(draw, length):
    cuts = sorted(draw(st.sets(st.integers(1, length), max_size=length)) | {length})
    if draw(st.booleans()):
        cuts.append(length)  # a final response without new ids
    return cuts


@st.composite
def streamed(draw, ids_strategy):
    ids = draw(ids_strategy)
    return ids, draw(cuts_for(len(ids)))


def fragments(tokenizer):
    """Ids of multi-byte texts: byte tokens and pieces of characters, to draw in any order."""
    encodings = (tokenizer.encode(text, add_special_tokens=False) for text in MULTIBYTE_TEXTS)
    return sorted({i for ids in encodings for i in ids})


def special_ids(tokenizer):
    return sorted(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


def text_ids(tokenizer):
    return (
        st.text(alphabet=ALPHABET, min_size=1, max_size=30)
        .map(lambda text: tokenizer.encode(text, add_special_tokens=False))
        .filter(len)
    )


# ---------------------------------------------------------------- examples


def test_window_start():
    sent = (0, 1, DETOKENIZE_CONTEXT, DETOKENIZE_CONTEXT + 5)
    assert [window_start(n) for n in sent] == [0, 0, 0, 5]
    with pytest.raises(ValueError, match="num_sent must be >= 0"):
        window_start(-1)


def test_leading_spaces_survive_token_by_token(smollm2, sentencepiece):
    for tokenizer in (smollm2, sentencepiece):
        ids = tokenizer.encode("Hello world", add_special_tokens=False)
        deltas = stream(tokenizer, ids, list(range(1, len(ids) + 1)))
        assert "".join(deltas) == "Hello world"
        assert any(delta.startswith(" w") for delta in deltas)
    assert stream(smollm2, [19556, 905], [1, 2]) == ["Hello", " world"]


def test_a_split_character_is_sent_once_whole(smollm2, sentencepiece):
    for tokenizer in (smollm2, sentencepiece):
        ids = tokenizer.encode("a😀b", add_special_tokens=False)
        assert len(ids) > 3  # the emoji spans several tokens
        deltas = stream(tokenizer, ids, list(range(1, len(ids) + 1)))
        assert "".join(deltas) == "a😀b"
        assert "😀" in deltas and all("\ufffd" not in delta for delta in deltas)


def test_long_runs_of_split_characters_cross_the_window(smollm2, sentencepiece):
    text = "ok " + "🙂" * 12 + " 日本語" * 5 + " done"
    for tokenizer in (smollm2, sentencepiece):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 3 * DETOKENIZE_CONTEXT
        deltas = stream(tokenizer, ids, list(range(1, len(ids) + 1)))
        assert "".join(deltas) == text
        assert all("\ufffd" not in delta for delta in deltas)


def test_skipped_special_token_anywhere_inside_split_characters(smollm2, sentencepiece):
    text = "ok " + "🙂" * 4 + " done"
    for tokenizer in (smollm2, sentencepiece):
        ids = tokenizer.encode(text, add_special_tokens=False)
        special = special_ids(tokenizer)[0]
        for position in range(len(ids) + 1):
            with_special = ids[:position] + [special] * 2 + ids[position:]
            deltas = stream(tokenizer, with_special, list(range(1, len(with_special) + 1)))
            assert "".join(deltas) == text, position


def test_three_skipped_special_tokens_inside_the_last_character_of_a_response(sentencepiece):
    """A response that ends inside a character whose bytes have skipped special tokens between
    them holds the character back whole (found by the property test below: three special tokens
    used to push the character's lead byte out of the tail that was searched)."""
    text = "a.aaaa🎉🎉🎉"
    ids = sentencepiece.encode(text, add_special_tokens=False)
    after_lead = len(ids) - 3  # the last emoji's bytes are the last 4 tokens
    ids[after_lead:after_lead] = [special_ids(sentencepiece)[0]] * 3
    for cuts in (
        [1, len(ids) - 1, len(ids)],
        [len(ids) - 2, len(ids)],
        list(range(1, len(ids) + 1)),
    ):
        deltas = stream(sentencepiece, ids, cuts)
        assert "".join(deltas) == text, cuts
        assert all("\ufffd" not in delta for delta in deltas), cuts


def test_non_streamed_response_is_the_full_decode(smollm2):
    ids = smollm2.encode(MULTIBYTE_TEXTS[0], add_special_tokens=False)
    assert text_delta(smollm2, ids, 0, True) == smollm2.decode(ids) == MULTIBYTE_TEXTS[0]


def test_final_response_without_new_ids_releases_held_text(smollm2):
    ids = smollm2.encode("a😀", add_special_tokens=False)[:-1]  # ends inside the emoji
    deltas = stream(smollm2, ids, [len(ids), len(ids)])
    assert deltas == ["a", smollm2.decode(ids)[1:]]
    assert deltas[1].endswith("\ufffd")


def test_special_tokens_are_skipped_or_kept(smollm2):
    ids = [1] + smollm2.encode("Hi", add_special_tokens=False) + [2]
    assert "".join(stream(smollm2, ids, [1, 2, 3])) == "Hi"
    kept = stream(smollm2, ids, [1, 2, 3], skip_special_tokens=False)
    assert "".join(kept) == "<|im_start|>Hi<|im_end|>"


def test_num_context_must_lie_in_the_window(smollm2):
    for num_context in (-1, 3):
        with pytest.raises(ValueError, match=r"num_context must be in \[0, 2\]"):
            text_delta(smollm2, [19556, 905], num_context, False)


def test_cleanup_that_breaks_the_prefix_falls_back_without_repeating_text():
    tokenizer = AutoTokenizer.from_pretrained(
        smollm2_tokenizer_dir(),
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    a, space, dot = (tokenizer.encode(t, add_special_tokens=False) for t in ("a", " ", "."))
    ids = a + space + dot + a
    assert tokenizer.decode(ids[:2]) == "a " and tokenizer.decode(ids[:3]) == "a."  # not a prefix
    deltas = stream(tokenizer, ids, [1, 2, 3, 4])
    assert deltas == ["a", " ", ".", "a"]  # documented fallback: the removed space stays
    assert "".join(stream(tokenizer, ids, [4])) == tokenizer.decode(ids) == "a.a"


# ---------------------------------------------------------------- properties


@pytest.fixture(scope="module")
def smollm2_random_ids(smollm2):
    pool = fragments(smollm2)
    any_id = st.one_of(
        st.sampled_from(pool),
        st.sampled_from(pool),
        st.integers(0, len(smollm2) - 1),
        st.sampled_from(special_ids(smollm2)),
    )
    return st.lists(any_id, min_size=1, max_size=40)


@PROPERTY
@given(data=st.data())
def test_byte_level_any_id_stream_any_split(smollm2, smollm2_random_ids, data):
    ids, cuts = data.draw(streamed(smollm2_random_ids))
    assume(within_contract(smollm2, ids, cuts))
    for skip in (True, False):
        deltas = stream(smollm2, ids, cuts, skip_special_tokens=skip)
        assert "".join(deltas) == smollm2.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(data=st.data())
def test_text_streams_any_split_never_break_a_character(smollm2, sentencepiece, data):
    for tokenizer in (smollm2, sentencepiece):
        ids, cuts = data.draw(streamed(text_ids(tokenizer)))
        deltas = stream(tokenizer, ids, cuts)
        assert "".join(deltas) == tokenizer.decode(ids)
        assert all("\ufffd" not in delta for delta in deltas)


@PROPERTY
@given(data=st.data())
def test_byte_fallback_valid_streams_with_specials_and_replacement_chars(sentencepiece, data):
    """Concatenated text pieces (byte runs stay valid UTF-8, U+FFFD included as a character),
    whole tokens and skipped special tokens anywhere, even inside a character."""
    tokenizer = sentencepiece
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    whole_tokens = [i for i, token in enumerate(tokens) if not token.startswith("<")]
    piece = st.one_of(
        st.text(alphabet=ALPHABET + "\ufffd", min_size=1, max_size=12).map(
            lambda text: tokenizer.encode(text, add_special_tokens=False)
        ),
        st.lists(st.sampled_from(whole_tokens), min_size=1, max_size=3),
    )
    ids = [i for part in data.draw(st.lists(piece, min_size=1, max_size=6)) for i in part]
    for _ in range(data.draw(st.integers(0, 3))):
        special = data.draw(st.sampled_from(special_ids(tokenizer)))
        ids.insert(data.draw(st.integers(0, len(ids))), special)
    if not ids:
        return
    cuts = data.draw(cuts_for(len(ids)))
    assume(within_contract(tokenizer, ids, cuts))
    assert "".join(stream(tokenizer, ids, cuts)) == tokenizer.decode(ids, skip_special_tokens=True)


class OpaqueTokenizer:
    """A tokenizer whose token bytes the detokenizer cannot see (no backend decoder)."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode
        self.convert_ids_to_tokens = tokenizer.convert_ids_to_tokens
        self.added_tokens_decoder = tokenizer.added_tokens_decoder


@PROPERTY
@given(data=st.data())
def test_unknown_token_bytes_fall_back_to_replacement_characters(smollm2, smollm2_random_ids, data):
    opaque = OpaqueTokenizer(smollm2)
    ids, cuts = data.draw(streamed(st.one_of(smollm2_random_ids, text_ids(smollm2))))
    assume(within_contract(smollm2, ids, cuts))
    assert "".join(stream(opaque, ids, cuts)) == smollm2.decode(ids, skip_special_tokens=True)


def test_byte_level_alphabet_matches_transformers():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from postprocessing.detokenizer import _BYTE_LEVEL_ALPHABET

    assert _BYTE_LEVEL_ALPHABET == {char: byte for byte, char in bytes_to_unicode().items()}


def test_special_tokens_inside_a_split_character_at_the_window_start(smollm2):
    """Three skipped special tokens inside a character, then a response without new ids: the
    last window still reaches the character's lead byte (found by the property test above when
    the window held 8 ids: the byte-level ids of 袢, three special tokens, stray bytes)."""
    opaque = OpaqueTokenizer(smollm2)
    ids = [179, 112, 112, 0, 0, 0, 112, 112, 112]
    for tokenizer in (smollm2, opaque):
        assert "".join(stream(tokenizer, ids, [9, 9])) == smollm2.decode(
            ids, skip_special_tokens=True
        )
