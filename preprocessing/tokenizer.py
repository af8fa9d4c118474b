"""A model's tokenizer, read with the `tokenizers` library alone, and TensorRT-LLM's text rules.

The Triton models that tokenize and detokenize run in the stubs' environment, which needs numpy
1.x for tritonserver 2.51 and should stay light: importing transformers there pulls in torch
(hundreds of MB per stub, and a torch built for numpy 2 fails under numpy 1). So `Tokenizer`
reads a model directory's `tokenizer.json` and `tokenizer_config.json` the way transformers'
fast tokenizer (v5) does, and offers the part of its interface this project uses:

- special tokens (bos/eos/unk/pad and the extra ones) from tokenizer_config.json (or
  special_tokens_map.json), added as special tokens when tokenizer.json lacks them;
- special tokens around a text come from tokenizer.json's post-processor alone (transformers 5
  ignores `add_bos_token` / `add_eos_token` in tokenizer_config.json for these tokenizers too);
- decode: the backend's decode; `clean_up_tokenization_spaces` only for non-BPE models, as in
  transformers 5;
- the chat template (tokenizer_config.json or chat_template.jinja) rendered with jinja2 in a
  sandbox with transformers' options and helpers, then encoded without special tokens.
Tests hold it equal to transformers' AutoTokenizer on the project's tokenizers.

TensorRT-LLM's rules on top (its preprocessing model): pad on the left, pad = eos when there is
no pad token, end/pad ids = the first id of the eos/pad token's text.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Sequence, Union

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

Messages = Sequence[dict]
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
EXTRA_SPECIAL_KEYS = ("additional_special_tokens", "extra_special_tokens")


class Tokenizer:
    padding_side = "left"

    def __init__(self, backend: BackendTokenizer, config: dict, chat_template: str | None = None):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens = {
            name: _content(config[name])
            for name in SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        extra = []
        for key in EXTRA_SPECIAL_KEYS:
            values = config.get(key) or []
            extra += [
                _content(v) for v in (values.values() if isinstance(values, dict) else values)
            ]
        self.extra_special_tokens = list(dict.fromkeys(extra))
        known = {str(t.content) for t in backend.get_added_tokens_decoder().values()}
        missing = [
            t for t in [*self.special_tokens.values(), *self.extra_special_tokens] if t not in known
        ]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True) for t in missing])

    @classmethod
    def from_dir(cls, directory: str) -> "Tokenizer":
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no tokenizer.json in {directory}: save the tokenizer in the fast format, e.g. "
                "AutoTokenizer.from_pretrained(d).save_pretrained(d) with transformers"
            )
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            file = os.path.join(directory, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    config.update(json.load(f))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        return cls(BackendTokenizer.from_file(path), config, template)

    # ---- the transformers interface this project uses -------------------------------------------
    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @eos_token.setter
    def eos_token(self, value: str | None) -> None:
        self.special_tokens["eos_token"] = value

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @pad_token.setter
    def pad_token(self, value: str | None) -> None:
        self.special_tokens["pad_token"] = value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend_tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special_tokens
        )
        if self.clean_up_tokenization_spaces and not self._is_bpe:
            text = _clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend_tokenizer.token_to_id(token)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def all_special_ids(self) -> list[int]:
        tokens = dict.fromkeys([*self.special_tokens.values(), *self.extra_special_tokens])
        ids = (self.convert_tokens_to_ids(t) for t in tokens if t is not None)
        return [i for i in ids if i is not None]

    def apply_chat_template(
        self, messages: Messages, add_generation_prompt: bool = True
    ) -> list[int]:
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template; send the prompt as plain text instead"
            )
        text = _compiled_template(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **{name: value for name, value in self.special_tokens.items() if value is not None},
        )
        return self.encode(text, add_special_tokens=False)

    # ---- internals ----
    @property
    def _is_bpe(self) -> bool:
        return type(self.backend_tokenizer.model).__name__ == "BPE"


def _content(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value["content"] if isinstance(value, dict) else str(value)


def _clean_up_tokenization(text: str) -> str:
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


_TEMPLATES: dict[str, object] = {}


def _compiled_template(source: str):
    """A chat template compiled as transformers compiles them (sandbox, trim_blocks,
    lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`, and
    `{% generation %}` blocks rendered as their content)."""
    if source not in _TEMPLATES:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body, lineno=lineno)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


# ---- TensorRT-LLM's preprocessing rules ---------------------------------------------------------
def load_tokenizer(tokenizer_dir: str) -> Tokenizer:
    """The tokenizer in ``tokenizer_dir``, padding on the left, pad token = eos token if unset."""
    tokenizer = Tokenizer.from_dir(str(tokenizer_dir))
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
    if isinstance(user_text_or_messages, str):
        messages = [{"role": "user", "content": user_text_or_messages}]
    else:
        messages = list(user_text_or_messages)
    return [int(i) for i in tokenizer.apply_chat_template(messages, add_generation_prompt=True)]


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
