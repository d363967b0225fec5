"""A fast tokenizer that transformers saved, served with the `tokenizers` library alone.

Owns: reading a directory written by transformers' `save_pretrained` for a fast tokenizer
(tokenizer.json, tokenizer_config.json, chat_template.jinja) and answering the
`models.tokenizer.Tokenizer` protocol from it: encode and decode (the Rust tokenizer's, as
transformers calls it), the special tokens and ids, the chat template (rendered by
`models.tokenizer.render_chat_template`, transformers' sandbox and filters), each token's raw
bytes where the vocabulary is byte-level (GPT-2's alphabet: what structured output's vocabulary
and logprobs' `bytes` are built from), and the serialized tokenizer for the other kinds.

A GGUF file's byte-level BPE tokenizer is converted by transformers once (models.hf_tokenizer,
in a child process) and then served from the saved copy this way, so a server never imports
transformers: transformers and its tokenizer hold 76 MiB resident against 30 MiB for the Rust
tokenizer alone, which counts against a K-quant file's memory budget.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from models.tokenizer import render_chat_template

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# transformers' `clean_up_tokenization` (applied in decode when a tokenizer's config asks for it).
_CLEAN_UP = (
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
)


def _byte_level_alphabet() -> dict[str, bytes]:
    """GPT-2's byte-level alphabet, character -> its byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in shown]
    chars = {chr(b): bytes((b,)) for b in shown}
    chars.update((chr(0x100 + k), bytes((b,))) for k, b in enumerate(hidden))
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def saved_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template save_pretrained wrote: chat_template.jinja (transformers 4.5x
    and later), else the config's `chat_template` (a string, or named templates)."""
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None


class SavedTokenizer:
    """A saved fast tokenizer as a `models.tokenizer.Tokenizer`, without transformers."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = sorted(self.backend.get_added_tokens_decoder().items())
        # Special and added tokens, text -> id (transformers' get_added_vocab).
        self.added_vocab: dict[str, int] = {t.content: i for i, t in added}
        # the added tokens marked special: no bytes of their own (token_bytes)
        self._special_ids = frozenset(i for i, t in added if t.special)
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        self.bos_token_id = self._id("bos_token")
        self.eos_token_id = self._id("eos_token")
        self.pad_token_id = self._id("pad_token")
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        # the loader sets them: the file's declared ids first (models.hf_tokenizer.end_ids)
        self.eos_token_ids: tuple[int, ...] = ()
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template: str | None = saved_chat_template(directory, config)
        self._byte_level = isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel)

    def _id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special-token text ("<|im_start|>") maps to its id, as rendered chat templates need.
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def template_tokens(self) -> dict[str, str]:
        """The special-token names a chat template may use (bos_token, eos_token, ...)."""
        return dict(self.special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, **self.template_tokens()
        )

    def token_bytes(self, token_id: int) -> bytes | None:
        """A byte-level vocabulary's token as raw bytes (its characters mapped back through
        the alphabet, as the ByteLevel decoder does; b"" for a special token or an id past the
        vocabulary); None for other vocabularies, whose text exists only as decoded text."""
        if not self._byte_level:
            return None
        if token_id in self._special_ids:
            return b""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        return b"".join(_BYTE_LEVEL.get(c) or c.encode() for c in piece)

    def incremental_decoder(self) -> None:
        return None

    def serialized(self) -> str:
        """The tokenizer as tokenizer.json text, without padding or truncation (llguidance)."""
        backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()
