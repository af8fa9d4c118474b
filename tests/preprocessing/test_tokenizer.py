import functools
import json
import random
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from preprocessing.tokenizer import (
    Tokenizer,
    apply_chat_template,
    default_end_id,
    default_pad_id,
    encode,
    load_tokenizer,
)
from tests.tokenizer_fixtures import (
    TRAINING_TEXT,
    sentencepiece_tokenizer_dir,
    smollm2_tokenizer_dir,
)


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


# ---- the tokenizers-only Tokenizer against transformers' AutoTokenizer --------------------------
TEXTS = [
    *TRAINING_TEXT,
    "",
    " ",
    "  leading",
    "a.b , c !",
    "<|im_start|>user\nhi<|im_end|>",
    "</s> x <s>",
    "emoji 🎉🎉 and 日本",
    "\x00ctrl\t\n",
    "mixed  spaces   .",
]


def _tokenizer_dirs() -> list[str]:
    return [
        smollm2_tokenizer_dir(),
        sentencepiece_tokenizer_dir("llama2"),
        sentencepiece_tokenizer_dir("metaspace"),
    ]


@pytest.mark.parametrize("index", range(3), ids=["smollm2", "sp-llama2", "sp-metaspace"])
def test_tokenizer_matches_transformers(index):
    directory = _tokenizer_dirs()[index]
    hf, ours = AutoTokenizer.from_pretrained(directory), Tokenizer.from_dir(directory)
    assert len(ours) == len(hf)
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(
                text, add_special_tokens=add
            )
    rng = random.Random(index)
    for _ in range(300):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.all_special_ids == hf.all_special_ids
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        hf.bos_token,
        hf.eos_token,
        hf.pad_token,
    )
    assert {i: t.special for i, t in ours.added_tokens_decoder.items()} == {
        i: t.special for i, t in hf.added_tokens_decoder.items()
    }


@given(st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_tokenizer_encodes_any_text_as_transformers_does(text):
    hf, ours = _smollm2_pair()
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text))


@functools.lru_cache(maxsize=None)
def _smollm2_pair():
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()), Tokenizer.from_dir(
        smollm2_tokenizer_dir()
    )


def test_chat_template_matches_transformers():
    hf, ours = _smollm2_pair()
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "é 🎉"},
        ],
    ):
        expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert ours.apply_chat_template(messages) == list(expected)


@pytest.mark.parametrize("post_processor", [True, False])
def test_add_bos_token_in_the_config_is_ignored_as_by_transformers(tmp_path, post_processor):
    shutil.copytree(sentencepiece_tokenizer_dir("metaspace"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    if not post_processor:
        backend = json.loads((tmp_path / "tokenizer.json").read_text())
        (tmp_path / "tokenizer.json").write_text(json.dumps({**backend, "post_processor": None}))
    hf, ours = AutoTokenizer.from_pretrained(str(tmp_path)), Tokenizer.from_dir(str(tmp_path))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)


def test_a_directory_without_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        load_tokenizer(str(tmp_path))


def test_the_stub_side_imports_neither_torch_nor_transformers():
    code = (
        "import sys; from preprocessing.tokenizer import load_tokenizer; "
        "import preprocessing.word_lists, preprocessing.prompt, postprocessing.detokenizer, "
        "ensemble.params, "
        "backend.process.client, backend.loading.model_paths, ensemble.environment; "
        f"t = load_tokenizer({smollm2_tokenizer_dir()!r}); t.decode(t.encode('hi')); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
