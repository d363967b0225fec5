"""Tokenizers and incremental detokenization.

`Tokenizer` is the small interface the server uses (encode, decode, special ids, chat template,
and what a tokenizer can say about single tokens: raw bytes, a streaming byte decoder).
`ByteTokenizer` is TinyGPT's: bytes 0-255 plus BOS/EOS/PAD. Real models wrap a Hugging Face
tokenizer (models.hf_tokenizer) or, for Gemma's GGUF vocabularies, models.spm_tokenizer. `IncrementalDetokenizer` turns a growing list of ids into text
deltas without ever emitting half a character, for any tokenizer: byte-level pieces whose text only
appears once later ids arrive are held back until they decode cleanly.
"""

from __future__ import annotations

import codecs
import datetime
import functools
import json
from typing import Protocol, runtime_checkable

import jinja2.ext
import jinja2.sandbox


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes of one token when they are defined on their own (a byte-level
        vocabulary: possibly a fragment of a UTF-8 character, b"" for a special token); None
        when a token's text only exists as decoded text."""
        ...

    def incremental_decoder(self) -> codecs.IncrementalDecoder | None:
        """A streaming decoder over `token_bytes` for tokenizers whose every token has bytes of
        its own (bytes, SentencePiece pieces), which detokenizes exactly; None: detokenize by
        decoding windows of ids."""
        ...


# A minimal template for the byte model: it has no chat training, but the server path is the same.
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters ("<" -> "\\u003c"), which would
    # change how tool schemas read in a prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=32)
def _compiled(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(
    template: str, messages: list[dict], add_generation_prompt: bool, **kw
) -> str:
    """Render a Jinja chat template in a sandbox, as transformers does (its globals, such as
    the `raise_exception` Gemma's template calls on roles that do not alternate, its `tojson`
    and `{% break %}` / `{% continue %}`). Compiled templates are cached by their text."""
    return _compiled(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **kw
    )


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; BOS 256, EOS 257, PAD 258 (vocab 260, one id spare)."""

    BOS, EOS, PAD = 256, 257, 258

    def __init__(self, vocab_size: int = 260) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)
        self.pad_token_id = self.PAD
        self.chat_template = BYTE_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Special ids have no bytes; an incomplete UTF-8 tail decodes to U+FFFD, which the
        # incremental detokenizer uses as its "wait for more" signal.
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt)

    def token_bytes(self, token_id: int) -> bytes | None:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def incremental_decoder(self) -> codecs.IncrementalDecoder:
        """A UTF-8 decoder that holds back only a tail that can still become a character.

        Invalid bytes (a random model emits plenty) come out as U+FFFD at once instead of
        stalling the stream until the next valid character.
        """
        return codecs.getincrementaldecoder("utf-8")(errors="replace")


class IncrementalDetokenizer:
    """Text deltas from a growing id list, holding back anything that is not yet whole.

    Decoding ids one at a time breaks on two things: a UTF-8 character split across byte-level
    tokens, and tokenizers whose piece text depends on its neighbours (leading-space markers).
    So decode a short window ending at the newest id and emit only what extends the text already
    emitted for the same window, as vLLM and TGI do. Text ending in U+FFFD is held back.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        # Special tokens whose text stays in the output (a chat format's structure, such as
        # harmony's <|channel|>, which its parser reads); every other special token is dropped.
        self.keep = keep
        # Tokenizers whose tokens are bytes decode exactly with a streaming UTF-8 decoder over
        # them; others use the window.
        self._utf8 = tokenizer.incremental_decoder()
        self.ids: list[int] = list(prompt_ids or [])
        # Start the window a few ids before the end of the prompt so the first generated piece
        # decodes in context (a leading space after a prompt word, say).
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        if not self.keep or self.keep.isdisjoint(new_ids):
            return self._add(new_ids)
        # A kept special token is a boundary: the text before it is flushed whole (a byte-level
        # piece cannot continue across it), then its own text, then decoding starts afresh.
        out: list[str] = []
        run: list[int] = []
        for i in new_ids:
            if i not in self.keep:
                run.append(i)
                continue
            if run:
                out.append(self._add(run))
                run = []
            out.append(self.flush())
            special = self.tokenizer.decode([i], skip_special_tokens=False)
            self.ids.append(i)
            self.prefix_offset = self.read_offset = len(self.ids)
            self.text += special
            out.append(special)
        if run:
            out.append(self._add(run))
        return "".join(out)

    def _add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        if self._utf8 is not None:
            piece = self.tokenizer.token_bytes
            delta = self._utf8.decode(b"".join(piece(i) or b"" for i in new_ids))
            self.text += delta
            return delta
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (incomplete bytes as U+FFFD)."""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
            self.text += delta
            return delta
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
