"""A compact SentencePiece-BPE tokenizer read straight from a GGUF file.

Owns: reading a GGUF's `tokenizer.*` metadata (tokens, scores, token types, flags, chat template)
without a GGUF library, and tokenizing with it as transformers' GGUF conversion of the same file
does (`GemmaTokenizer`: the files whose `tokenizer.ggml.model` is "llama" and whose architecture
is Gemma's), behind the `models.tokenizer.Tokenizer` protocol.

Why not that conversion: a SentencePiece GGUF has no merges table, so transformers derives one
from the vocabulary (514,906 merges for Gemma's 262,144 tokens); the `tokenizers` BPE holding it
costs ~300 MB of RSS, and the conversion itself peaks near 1.7 GB. Every merge it derives is "two
tokens whose concatenation is a token", ranked by the merged token's place in the file and then by
the longer left piece, so the rank of any adjacent pair can be computed from the vocabulary alone:
one dict from token text to id is all this tokenizer keeps.

How a text is encoded (the conversion's steps, in its order):
1. Control tokens (type 3) and user-defined tokens (type 4) are cut out of the raw text wherever
   they occur, leftmost and then longest first (`<start_of_turn>`, "\n\n", `</div>`). Gemma stores
   its runs of spaces as user-defined tokens spelled with real spaces; the conversion respells them
   with U+2581 and does not match them as added tokens, so neither do we.
2. In each remaining piece spaces become U+2581; the piece starts as one symbol per character (a
   character missing from the vocabulary becomes its UTF-8 bytes as `<0xXX>` tokens).
3. Repeatedly merge the adjacent pair with the best rank (leftmost among equals), with a heap,
   word by word where no merge can cross a word's start (see `SPMTokenizer.__init__`).

As in the conversion, merges rank by the merged token's place in the file, not by its score as
llama.cpp's SentencePiece tokenizer does (Gemma's normal tokens are stored best score first, so
the two rarely differ), and the file's add_space_prefix flag is not applied (Gemma's files set
it false).
"""

from __future__ import annotations

import codecs
import heapq
import mmap
import re
import struct
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.gguf_reader import GGUF_MAGIC
from models.tokenizer import render_chat_template

# GGUF metadata value types (llama.cpp's gguf.h), with struct formats for the fixed-size ones.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Token types (llama.cpp's llama_token_attr order in GGUF files).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"
# Architectures whose SentencePiece vocabulary transformers converts with `GemmaTokenizer`.
# (A Gemma 4 file's own vocabulary is "gemma4" BPE with merges; one written with Gemma 3's, as
# tools.synth_model writes it, is read as Gemma 3's.)
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3", "gemma4"})


def read_gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """`general.architecture` and every `tokenizer.*` key of a GGUF file, from its header only.

    Strings are str, arrays are lists (strings) or `array.array` (numbers). A memory map and one
    pass over the header: no per-item objects beyond the token strings themselves.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        off = 24
        out: dict[str, Any] = {}

        def string(off: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", mm, off)
            return mm[off + 8 : off + 8 + n].decode("utf-8", errors="replace"), off + 8 + n

        def value(kind: int, off: int, keep: bool) -> tuple[Any, int]:
            if kind == _STRING:
                return string(off)
            if kind in _FIXED:
                fmt = _FIXED[kind]
                return struct.unpack_from("<" + fmt, mm, off)[0], off + struct.calcsize(fmt)
            if kind != _ARRAY:
                raise ValueError(f"{path}: unknown GGUF metadata type {kind}")
            item, count = struct.unpack_from("<IQ", mm, off)
            off += 12
            if item in _FIXED:
                size = struct.calcsize(_FIXED[item])
                items = array(_FIXED[item].replace("?", "B")) if keep else None
                if keep:
                    items.frombytes(mm[off : off + size * count])
                return items, off + size * count
            items = [] if keep else None
            for _ in range(count):
                v, off = value(item, off, keep)
                if keep:
                    items.append(v)
            return items, off

        for _ in range(n_kv):
            key, off = string(off)
            (kind,) = struct.unpack_from("<I", mm, off)
            keep = key.startswith("tokenizer.") and key != "tokenizer.ggml.merges"
            v, off = value(kind, off + 4, keep or key == "general.architecture")
            if keep or key == "general.architecture":
                out[key] = v
        return out


def uses_spm_tokenizer(meta: Mapping[str, Any]) -> bool:
    """Whether `SPMTokenizer` serves this file (else transformers' conversion does).

    Gemma's SentencePiece vocabularies (256k-262k tokens) are the ones whose derived merges cost
    hundreds of MB; for them this tokenizer reproduces transformers' `GemmaTokenizer` exactly.
    Other SentencePiece files (Llama 2, Mistral v0.1, Phi-3: 32k tokens, a few MB of merges) keep
    the conversion, whose Metaspace and normalizer quirks differ per architecture."""
    return (
        meta.get("tokenizer.ggml.model") == "llama"
        and meta.get("general.architecture") in GEMMA_ARCHITECTURES
        and "tokenizer.ggml.merges" not in meta
    )


class SPMTokenizer:
    """Gemma's SentencePiece BPE as a `models.tokenizer.Tokenizer` (see the module docstring)."""

    def __init__(
        self,
        tokens: list[str],
        token_types: Any = None,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos: bool = True,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        n = len(tokens)
        types = token_types if token_types is not None else array("i", [NORMAL]) * n
        self.vocab_size = n
        # Whitespace tokens with a space in them (Gemma's runs of spaces) are looked up as U+2581
        # runs, as the conversion respells them; every other token keeps its spelling.
        self._tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        self._ids = {t: i for i, t in enumerate(self._tokens)}  # later duplicates win, as there
        self._max_len_bits = max(1, max(map(len, self._tokens), default=1).bit_length())
        # Added tokens, cut out of raw text: control ones (special: skipped by decode) and
        # user-defined ones under their own spelling.
        named = (bos_token_id, eos_token_id, unk_token_id, pad_token_id)
        special = {i for i in range(n) if types[i] == CONTROL}
        special.update(i for i in named if i is not None and 0 <= i < n)
        self.special_ids = frozenset(special)
        added = {}
        for i in range(n):
            if (i in special or types[i] == USER_DEFINED) and tokens[i] in self._ids:
                added[tokens[i]] = self._ids[tokens[i]]
        self.added_vocab: dict[str, int] = added
        by_first: dict[str, set[int]] = {}
        for t in added:
            by_first.setdefault(t[0], set()).add(len(t))
        self._added_lengths = {c: sorted(ls, reverse=True) for c, ls in by_first.items()}
        self._added_start = (
            re.compile("[" + "".join(re.escape(c) for c in by_first) + "]") if by_first else None
        )
        self._bytes = [self._ids.get(f"<0x{b:02X}>") for b in range(256)]
        # Merging a whole text at once is the conversion's semantics, but no merge can cross
        # the start of a U+2581 run unless some token holds the character before it followed by
        # U+2581 (in Gemma's vocabulary only ">" does, in ">\u2581</"): split the text there
        # into words, merge each on its own (the same result) and cache them.
        inner = (t for t in self._tokens if SPACE in t[1:])
        before = {t[k - 1] for t in inner for k in range(1, len(t)) if t[k] == SPACE}
        before.add(SPACE)
        self._word_starts = re.compile(
            "(?<=[^" + "".join(re.escape(c) for c in sorted(before)) + "])(?=" + SPACE + ")"
        )
        self._cache: dict[str, tuple[int, ...]] = {}
        self.unk_token_id = unk_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos, self.add_eos = add_bos, add_eos
        self.eos_token_ids: tuple[int, ...] = () if eos_token_id is None else (eos_token_id,)
        if not chat_template and "<start_of_turn>" in added:
            from models.hf_tokenizer import GEMMA_CHAT_TEMPLATE

            chat_template = GEMMA_CHAT_TEMPLATE  # Gemma files may carry none (270M does not)
        self.chat_template: str | None = chat_template or None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> SPMTokenizer:
        def opt_int(key: str) -> int | None:
            v = meta.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)

        return cls(
            meta["tokenizer.ggml.tokens"],
            meta.get("tokenizer.ggml.token_type"),
            bos_token_id=opt_int("bos_token_id"),
            eos_token_id=opt_int("eos_token_id"),
            unk_token_id=opt_int("unknown_token_id"),
            pad_token_id=opt_int("padding_token_id"),
            # transformers (and llama.cpp) add BOS to a SentencePiece vocabulary unless told not to
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # -- encoding ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        start = 0
        for pos, token in self._added_matches(text):
            if pos > start:
                ids.extend(self._bpe(text[start:pos]))
            ids.append(self.added_vocab[token])
            start = pos + len(token)
        if start < len(text):
            ids.extend(self._bpe(text[start:]))
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _added_matches(self, text: str):
        """(position, token) of each added token in `text`: leftmost first, then longest."""
        if self._added_start is None:
            return
        added, lengths = self.added_vocab, self._added_lengths
        pos = 0
        while (m := self._added_start.search(text, pos)) is not None:
            i = m.start()
            for n in lengths[text[i]]:
                if text[i : i + n] in added:
                    yield i, text[i : i + n]
                    pos = i + n
                    break
            else:
                pos = i + 1

    def _bpe(self, text: str) -> list[int]:
        """The ids of a piece of text between added tokens: its words merged one by one."""
        out: list[int] = []
        cache = self._cache
        for word in self._word_starts.split(text.replace(" ", SPACE)):
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word)
                if len(cache) >= 20_000:  # a few MB at most
                    cache.clear()
                cache[word] = ids
            out.extend(ids)
        return out

    def _merge(self, text: str) -> tuple[int, ...]:
        ids, bits = self._ids, self._max_len_bits
        syms: list[str | None] = []
        for c in text:
            if c in ids:
                syms.append(c)
            else:
                syms.extend(self._fallback(c))
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # A heap of ints: (rank << 32) | position. A pair's rank is the merged token's id, then
        # the longer left piece first (the conversion's merge order); stale entries are skipped
        # when popped by recomputing the rank of the pair now at that position.
        heap = []
        for i in range(n - 1):
            t = ids.get(syms[i] + syms[i + 1])
            if t is not None:
                heap.append((((t << bits) | ((1 << bits) - 1 - len(syms[i]))) << 32) | i)
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        mask = (1 << 32) - 1
        while heap:
            key = pop(heap)
            i = key & mask
            left = syms[i]
            j = nxt[i]
            if left is None or j < 0:
                continue
            merged = left + syms[j]
            t = ids.get(merged)
            if t is None or ((t << bits) | ((1 << bits) - 1 - len(left))) != key >> 32:
                continue
            syms[i] = merged
            syms[j] = None
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                t = ids.get(merged + syms[k])
                if t is not None:
                    push(heap, (((t << bits) | ((1 << bits) - 1 - len(merged))) << 32) | i)
            h = prv[i]
            if h >= 0:
                t = ids.get(syms[h] + merged)
                if t is not None:
                    push(heap, (((t << bits) | ((1 << bits) - 1 - len(syms[h]))) << 32) | h)
        out: list[int] = []
        unk = self.unk_token_id
        i = 0 if n else -1
        while i >= 0:
            t = ids[syms[i]]
            if not (t == unk and out and out[-1] == unk):  # consecutive unknowns fuse
                out.append(t)
            i = nxt[i]
        return tuple(out)

    def _fallback(self, c: str) -> list[str]:
        """The symbols of a character missing from the vocabulary: its bytes, else unknown."""
        ids = [self._bytes[b] for b in c.encode("utf-8")]
        if all(i is not None for i in ids):
            return [self._tokens[i] for i in ids]
        if self.unk_token_id is None:
            raise ValueError(f"character {c!r} is not in the vocabulary and there is no <unk>")
        return [self._tokens[self.unk_token_id]]

    # -- decoding ----------------------------------------------------------------------------------

    def _byte_of(self, piece: str) -> int | None:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return int(piece[3:5], 16)
            except ValueError:
                return None
        return None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # As the conversion's decoder: U+2581 -> space per piece, runs of <0xXX> pieces decoded
        # as UTF-8 (a run that is not valid UTF-8 gives one U+FFFD per byte), then joined.
        parts: list[str] = []
        run = bytearray()
        n, special = self.vocab_size, self.special_ids
        for i in ids:
            if not 0 <= i < n or (skip_special_tokens and i in special):
                continue
            piece = self._tokens[i]
            b = self._byte_of(piece)
            if b is not None:
                run.append(b)
                continue
            if run:
                parts.append(_decode_run(run))
                run.clear()
            parts.append(piece.replace(SPACE, " "))
        if run:
            parts.append(_decode_run(run))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes | None:
        if not 0 <= token_id < self.vocab_size or token_id in self.special_ids:
            return b""
        piece = self._tokens[token_id]
        b = self._byte_of(piece)
        return bytes([b]) if b is not None else piece.replace(SPACE, " ").encode("utf-8")

    def incremental_decoder(self) -> codecs.IncrementalDecoder:
        # Every token has bytes of its own (a byte token a fragment of a character), so a
        # streaming UTF-8 decoder over them detokenizes exactly.
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, **self.template_tokens()
        )

    def template_tokens(self) -> dict[str, str]:
        """The special-token names a chat template may use (bos_token, eos_token, ...)."""
        named = {
            "bos_token": self.bos_token_id,
            "eos_token": self.eos_token_id,
            "unk_token": self.unk_token_id,
            "pad_token": self.pad_token_id,
        }
        return {
            k: self._tokens[v] for k, v in named.items() if v is not None and v < self.vocab_size
        }


def _decode_run(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def load_spm_tokenizer(path: str | Path) -> SPMTokenizer:
    return SPMTokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
