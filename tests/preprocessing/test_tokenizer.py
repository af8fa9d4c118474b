import pytest

from preprocessing.tokenizer import (
    apply_chat_template,
    default_end_id,
    default_pad_id,
    encode,
    load_tokenizer,
)
from tests.preprocessing.tokenizer_fixtures import sentencepiece_tokenizer_dir


def test_load_pads_on_the_left(smollm2, sentencepiece):
    assert smollm2.padding_side == "left"
    assert sentencepiece.padding_side == "left"


def test_load_uses_eos_as_pad_when_the_tokenizer_has_none(sentencepiece):
    assert sentencepiece.pad_token == sentencepiece.eos_token == "</s>"


def test_load_keeps_an_existing_pad_token(smollm2):
    assert smollm2.pad_token == "<|im_end|>"


def test_encode_returns_plain_ints(smollm2):
    ids = encode(smollm2, "Hello world")
    assert ids == [19556, 905]
    assert all(type(i) is int for i in ids)
    assert smollm2.decode(ids) == "Hello world"


def test_encode_rejects_non_text(smollm2):
    with pytest.raises(TypeError, match="text must be a str"):
        encode(smollm2, b"Hello")


def test_chat_template_of_a_user_text(smollm2):
    ids = apply_chat_template(smollm2, "What is 2+2?")
    text = smollm2.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert all(type(i) is int for i in ids)


def test_chat_template_of_messages(smollm2):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = smollm2.decode(apply_chat_template(smollm2, messages))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert apply_chat_template(smollm2, "Hi") == apply_chat_template(
        smollm2, [{"role": "user", "content": "Hi"}]
    )


def test_chat_template_missing_is_a_clear_error(sentencepiece):
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(sentencepiece, "Hi")


def test_default_end_and_pad_ids(smollm2, sentencepiece):
    assert default_end_id(smollm2) == smollm2.convert_tokens_to_ids("<|im_end|>") == 2
    assert default_pad_id(smollm2) == 2
    assert default_end_id(sentencepiece) == sentencepiece.convert_tokens_to_ids("</s>")
    assert default_pad_id(sentencepiece) == default_end_id(sentencepiece)


def test_default_ids_without_eos_name_the_field():
    tokenizer = load_tokenizer(sentencepiece_tokenizer_dir("metaspace"))
    tokenizer.eos_token = None
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="no eos token; send end_id"):
        default_end_id(tokenizer)
    with pytest.raises(ValueError, match="no pad token; send pad_id"):
        default_pad_id(tokenizer)
