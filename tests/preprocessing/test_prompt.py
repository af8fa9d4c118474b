"""text_input -> prompt ids: plain, or in the model's chat template (the template read from the
GGUF metadata or tokenizer_config.json, rendered as transformers renders it)."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from preprocessing.prompt import encode_prompt
from preprocessing.tokenizer import Tokenizer, encode, load_tokenizer
from tests.tokenizer_fixtures import (
    sentencepiece_tokenizer_dir,
    smollm2_tokenizer_dir,
)

QUESTION = "What is the capital of France?"
# A template of our own, in the shape of those in tokenizer_config.json files (system prompt
# optional, strict alternation, the assistant's opener at the end).
INST_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}[INST] {% if loop.first and system is defined %}"
    "<<SYS>>{{ system }}<</SYS>> {% endif %}{{ message['content'] | trim }} [/INST]"
    "{% else %} {{ message['content'] | trim }}{{ eos_token }}{% endif %}{% endfor %}"
)
CONVERSATIONS = (
    [{"role": "user", "content": QUESTION}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of Spain? é 🎉"},
    ],
)


def _hf_ids(hf, messages) -> list[int]:
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def templated_dir(tmp_path_factory) -> str:
    """A Hugging Face tokenizer directory whose tokenizer_config.json carries a chat_template."""
    target = tmp_path_factory.mktemp("templated")
    shutil.copytree(sentencepiece_tokenizer_dir("llama2"), target, dirs_exist_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = INST_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return str(target)


def test_plain_text_is_encoded_as_it_is(smollm2):
    assert encode_prompt(smollm2, QUESTION, chat=False) == encode(smollm2, QUESTION)
    assert encode_prompt(smollm2, "Hi", chat=False, add_special_tokens=False) == encode(
        smollm2, "Hi", add_special_tokens=False
    )


def test_chat_prompt_equals_transformers_on_the_default_model():
    directory = smollm2_tokenizer_dir()
    hf, ours = AutoTokenizer.from_pretrained(directory), load_tokenizer(directory)
    ids = encode_prompt(ours, QUESTION, chat=True)
    assert ids == _hf_ids(hf, CONVERSATIONS[0])
    assert ours.decode(ids).endswith(
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == _hf_ids(hf, messages)


def test_the_default_models_template_is_the_ggufs():
    gguf = pytest.importorskip("gguf")
    from backend.loading.model_paths import default_gguf_path

    field = gguf.GGUFReader(default_gguf_path()).fields["tokenizer.chat_template"]
    assert load_tokenizer(smollm2_tokenizer_dir()).chat_template == field.contents()


def test_template_from_tokenizer_config_equals_transformers(templated_dir):
    hf, ours = AutoTokenizer.from_pretrained(templated_dir), Tokenizer.from_dir(templated_dir)
    assert ours.chat_template == INST_TEMPLATE
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == _hf_ids(hf, messages)
    assert encode_prompt(ours, QUESTION, chat=True) == _hf_ids(hf, CONVERSATIONS[0])


def test_a_template_that_refuses_the_conversation_is_a_clear_error(templated_dir):
    tokenizer = Tokenizer.from_dir(templated_dir)
    tokenizer.chat_template = INST_TEMPLATE.replace(
        "message['role'] == 'user') !=", "message['role'] == 'user') =="
    )
    with pytest.raises(
        ValueError,
        match="apply_chat_template: the model's chat template refused "
        "the message: roles must alternate",
    ):
        encode_prompt(tokenizer, QUESTION, chat=True)


def test_a_model_without_a_template_names_the_input(sentencepiece):
    assert sentencepiece.chat_template is None
    with pytest.raises(
        ValueError,
        match="apply_chat_template must be false for this model: its "
        "tokenizer has no chat template",
    ):
        encode_prompt(sentencepiece, QUESTION, chat=True)
    assert encode_prompt(sentencepiece, QUESTION, chat=False)


def test_empty_text_is_refused_either_way(smollm2):
    for chat in (False, True):
        with pytest.raises(ValueError, match="text_input must not be empty"):
            encode_prompt(smollm2, "", chat=chat)
