"""Loading a Hugging Face tokenizer and turning text into token ids, as TensorRT-LLM's
preprocessing model does (left padding, pad = eos when missing, end/pad ids from the eos/pad
token text)."""

from __future__ import annotations

from typing import Sequence, Union

Messages = Sequence[dict]


def load_tokenizer(tokenizer_dir: str):
    """The tokenizer in ``tokenizer_dir``, padding on the left, pad token = eos token if unset."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy; word lists need only encode()

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), padding_side="left")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def apply_chat_template(tokenizer, user_text_or_messages: Union[str, Messages]) -> list[int]:
    """Token ids of a chat prompt ending with the assistant's turn opener.

    A plain string is one user message; otherwise a list of ``{"role", "content"}`` dicts.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this tokenizer has no chat template; send the prompt as plain text instead"
        )
    if isinstance(user_text_or_messages, str):
        messages = [{"role": "user", "content": user_text_or_messages}]
    else:
        messages = list(user_text_or_messages)
    result = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = result["input_ids"] if hasattr(result, "keys") else result
    return [int(i) for i in ids]


def default_end_id(tokenizer) -> int:
    """TensorRT-LLM's default end id: the first id of the eos token's text."""
    return _first_id(tokenizer, tokenizer.eos_token, "eos", "end_id")


def default_pad_id(tokenizer) -> int:
    """TensorRT-LLM's default pad id: the first id of the pad token's text (eos if unset)."""
    return _first_id(tokenizer, tokenizer.pad_token or tokenizer.eos_token, "pad", "pad_id")


def _first_id(tokenizer, token_text, name: str, field: str) -> int:
    if not token_text:
        raise ValueError(f"the tokenizer has no {name} token; send {field} explicitly")
    ids = encode(tokenizer, token_text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer's {name} token {token_text!r} encodes to no ids")
    return ids[0]
