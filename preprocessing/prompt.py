"""A request's text_input -> prompt token ids: plain text, or one user message in the model's chat
template (the `apply_chat_template` input, else the repository's default).

The template is the model's own: the GGUF metadata `tokenizer.chat_template` (kept by the
conversion to a Hugging Face directory) or tokenizer_config.json's `chat_template`, rendered by
preprocessing.tokenizer.Tokenizer. Errors name the input and the rule.
"""

from __future__ import annotations

from jinja2.exceptions import TemplateError

from preprocessing.tokenizer import apply_chat_template, encode


def encode_prompt(tokenizer, text: str, chat: bool, add_special_tokens: bool = True) -> list[int]:
    if not text:
        raise ValueError("text_input must not be empty")
    if not chat:
        ids = encode(tokenizer, text, add_special_tokens=add_special_tokens)
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "apply_chat_template must be false for this model: its tokenizer has no "
            "chat template (neither tokenizer.chat_template in the GGUF file nor "
            "chat_template in tokenizer_config.json)"
        )
    else:  # the template writes its own special tokens
        try:
            ids = apply_chat_template(tokenizer, text)
        except TemplateError as exc:
            raise ValueError(
                f"apply_chat_template: the model's chat template refused the message: {exc}"
            ) from None
    if not ids:
        raise ValueError("text_input encodes to no tokens")
    return ids
