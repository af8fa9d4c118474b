import numpy as np
import pytest

from preprocessing.tokenizer import encode
from preprocessing.word_lists import (
    decode_word_list,
    embedding_bias,
    encode_word_list,
    parse_words,
    word_list_array,
)

# ---------------------------------------------------------------- parse_words


@pytest.mark.parametrize(
    "strings, words",
    [
        ("a,b", ["a", "b"]),
        (["Human:,Assistant:"], ["Human:", "Assistant:"]),
        (["a,b", "c"], ["a,b", "c"]),  # several elements: one word each
        ([b"stop", "\xe6\xad\xa2".encode("latin-1")], ["stop", "止"]),
        (np.array([[b"x,y"]], dtype=object), ["x", "y"]),
        ("a, b", ["a", " b"]),  # nothing trimmed
        ('"Hello, world",bye', ["Hello, world", "bye"]),
        ('"say ""hi""",x', ['say "hi"', "x"]),
        ('say "hi",x', ['say "hi"', "x"]),  # quotes inside a word are literal
        ("\n", ["\n"]),
        ("a,\n,b", ["a", "\n", "b"]),
        ("a,,b,", ["a", "b"]),
        ("", []),
        ([""], []),
        ([], []),
        (None, []),
    ],
)
def test_parse_words(strings, words):
    assert parse_words(strings) == words


@pytest.mark.parametrize(
    "strings, rule",
    [
        ('"open', "no closing quote"),
        ('"a"b,c', "must be followed by a comma or the end"),
        ([b"\xff\xfe"], "must be valid UTF-8"),
        ([1, 2], "must hold strings"),
    ],
)
def test_parse_words_rejects_with_field_and_rule(strings, rule):
    with pytest.raises(ValueError, match=rule) as error:
        parse_words(strings, field="stop_words")
    assert "stop_words" in str(error.value)


# ---------------------------------------------------------------- encode_word_list


def test_word_list_array_format():
    array = word_list_array([[5, 6], [7]])
    assert array.dtype == np.int32
    assert array.tolist() == [[5, 6, 7], [2, 3, -1]]


def test_no_words_is_shape_2_by_0(smollm2):
    for words in ([], [""], ["", ""]):
        array = encode_word_list(smollm2, words)
        assert array.shape == (2, 0) and array.dtype == np.int32
        assert decode_word_list(array, "stop_words") == []


def test_round_trip_with_leading_space_variants(smollm2, sentencepiece):
    for tokenizer in (smollm2, sentencepiece):
        words = ["Hello", " world", "日本", "😀!"]
        expected = []
        for word in words:
            variants = [word] if word.startswith(" ") else [word, " " + word]
            for variant in variants:
                ids = encode(tokenizer, variant, add_special_tokens=False)
                if ids not in expected:
                    expected.append(ids)
        array = encode_word_list(tokenizer, words)
        assert array.dtype == np.int32 and array.shape == (2, sum(map(len, expected)))
        assert decode_word_list(array, "bad_words") == expected
        assert decode_word_list(array[None], "bad_words") == expected


def test_mid_sentence_word_is_in_the_list(smollm2):
    sentence = encode(smollm2, "say Hello there", add_special_tokens=False)
    alone = encode(smollm2, "Hello", add_special_tokens=False)
    assert not _contains(sentence, alone)  # "Hello" mid-sentence is the token " Hello"
    sequences = decode_word_list(encode_word_list(smollm2, ["Hello"]), "stop_words")
    assert alone in sequences
    assert any(_contains(sentence, sequence) for sequence in sequences)


def test_identical_variants_are_listed_once(sentencepiece):
    hello = encode(sentencepiece, "Hello", add_special_tokens=False)
    spaced = encode(sentencepiece, " Hello", add_special_tokens=False)
    sequences = decode_word_list(encode_word_list(sentencepiece, ["Hello"]), "stop_words")
    assert sequences == ([hello] if hello == spaced else [hello, spaced])


def _contains(haystack, needle):
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack)))


# ---------------------------------------------------------------- decode_word_list


def test_decode_ignores_padding():
    array = np.array([[5, 6, 7, 0, 0], [2, 3, -1, -1, -1]], dtype=np.int32)
    assert decode_word_list(array, "stop_words") == [[5, 6], [7]]
    assert decode_word_list(np.array([[0, 0], [-1, -1]]), "stop_words") == []
    assert decode_word_list(np.zeros((1, 2, 0), dtype=np.int64), "stop_words") == []


@pytest.mark.parametrize(
    "array, rule",
    [
        (np.array([[1.0, 2.0], [1.0, 2.0]]), "must be an integer array"),
        (np.array([[True], [True]]), "must be an integer array"),
        (np.array([1, 2, 3]), r"must have shape \[2, N\] or \[1, 2, N\], got \[3\]"),
        (np.zeros((3, 2), dtype=np.int32), r"got \[3, 2\]"),
        (np.zeros((2, 2, 2), dtype=np.int32), r"got \[2, 2, 2\]"),
        (np.zeros((1, 2, 2, 1), dtype=np.int32), r"got \[1, 2, 2, 1\]"),
        (np.array([[5, 6], [2, 1]]), "strictly increasing"),
        (np.array([[5, 6], [2, 2]]), "strictly increasing"),
        (np.array([[5, 6], [0, 2]]), "strictly increasing and >= 1"),
        (np.array([[5, 6], [-2, -1]]), "strictly increasing and >= 1"),
        (np.array([[5, 6], [3, -1]]), "offset 3 at position 0 is beyond the 2 token ids"),
        (np.array([[5, 6, 7], [1, -1, 3]]), "followed only by -1 padding"),
        (np.array([[5, -6], [1, 2]]), "token ids must be >= 0, got -6 at position 1"),
    ],
)
def test_decode_rejects_malformed_arrays(array, rule):
    with pytest.raises(ValueError, match=rule) as error:
        decode_word_list(array, "bad_words_list")
    assert str(error.value).startswith("bad_words_list")


# ---------------------------------------------------------------- embedding_bias


def test_embedding_bias_gives_each_words_tokens_its_weight(smollm2):
    bias = embedding_bias(smollm2, ["Hello", " cruel world"], [1.5, -2.0], vocab_size=49152)
    hello = encode(smollm2, "Hello", add_special_tokens=False)
    cruel_world = encode(smollm2, " cruel world", add_special_tokens=False)
    assert len(cruel_world) == 2
    assert bias == {**{t: 1.5 for t in hello}, **{t: -2.0 for t in cruel_world}}


def test_embedding_bias_sums_shared_tokens_and_skips_empty_words(smollm2):
    (hello,) = encode(smollm2, "Hello", add_special_tokens=False)
    assert embedding_bias(smollm2, ["Hello", "", "Hello"], [1.0, 9.0, 0.25], 49152) == {hello: 1.25}
    assert embedding_bias(smollm2, [], [], 49152) == {}


def test_embedding_bias_errors(smollm2):
    with pytest.raises(ValueError) as error:
        embedding_bias(smollm2, ["a", "b"], [1.0, 2.0, 3.0], 49152)
    assert str(error.value) == (
        "embedding_bias_words and embedding_bias_weights must have the same length, got 2 and 3"
    )
    with pytest.raises(ValueError, match="embedding_bias_weights must be finite"):
        embedding_bias(smollm2, ["a"], [float("nan")], 49152)
    with pytest.raises(ValueError, match="embedding_bias_words: 'Hello' has token id 19556"):
        embedding_bias(smollm2, ["Hello"], [1.0], vocab_size=1000)


def test_word_lists_are_bounded():
    from preprocessing.word_lists import MAX_WORD_CHARS, MAX_WORDS

    assert len(parse_words(",".join(["w"] * MAX_WORDS), "stop_words")) == MAX_WORDS
    with pytest.raises(
        ValueError, match=f"bad_words has {MAX_WORDS + 1} words; at most {MAX_WORDS}"
    ):
        parse_words(",".join(["w"] * (MAX_WORDS + 1)), "bad_words")
    with pytest.raises(ValueError, match=f"bad_words has {MAX_WORDS + 1} words"):
        parse_words(np.array(["w"] * (MAX_WORDS + 1), dtype=object), "bad_words")
    with pytest.raises(ValueError, match=f"stop_words: a word of {MAX_WORD_CHARS + 1} characters"):
        parse_words("x" * (MAX_WORD_CHARS + 1), "stop_words")
