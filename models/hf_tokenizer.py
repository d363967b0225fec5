"""Hugging Face tokenizers behind the `models.tokenizer.Tokenizer` protocol.

Owns: loading a tokenizer and its chat template with `transformers.AutoTokenizer`, from a model
directory or from a GGUF file's metadata (transformers converts the GGUF vocabulary and merges into
a fast tokenizer); caching that conversion, made in a child process so that a server reading a
GGUF file serves the saved copy with `tokenizers` alone (`models.saved_tokenizer`) and never
imports transformers; and deciding which ids end a generation. Tokenization and template
rendering are transformers' and `tokenizers`' work, not ours.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from models.base import ModelLoadError, model_dir
from models.saved_tokenizer import SavedTokenizer

# Tokens that end a turn or a document in the chat formats of the Llama family (ChatML for SmolLM2
# and Qwen2, Llama 3, Phi-3, Gemma, Llama 2 / Mistral). A model that emits one of these is done even
# when its checkpoint declares a different EOS (SmolLM2's GGUF declares <|im_end|> but not
# <|endoftext|>; Llama 3 base declares <|end_of_text|> but its chat turns end with <|eot_id|>).
END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)

# o200k_harmony (gpt-oss): a turn ends with <|return|> (the answer) or <|call|> (a tool call);
# <|end|> closes one message within it (the reasoning before the answer), so a vocabulary that
# has both is not ended by <|end|> (llama.cpp drops it from the end tokens for the same reason).
HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")
HARMONY_MESSAGE_END = "<|end|>"

# Gemma's turns: "<start_of_turn>{user|model}\n...<end_of_turn>\n" after BOS; a system message
# has no role of its own and opens the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class HFTokenizer:
    """A transformers tokenizer as a `models.tokenizer.Tokenizer`."""

    def __init__(self, tok: Any, eos_token_ids: tuple[int, ...] | None = None) -> None:
        self.hf = tok  # the transformers tokenizer, for callers that need more (save_pretrained)
        self.vocab_size: int = len(tok)
        self.bos_token_id: int | None = tok.bos_token_id
        self.pad_token_id: int | None = tok.pad_token_id
        self.eos_token_ids: tuple[int, ...] = (
            eos_token_ids if eos_token_ids is not None else end_token_ids(tok, ())
        )
        template = tok.chat_template
        if isinstance(template, dict):  # older checkpoints: named templates
            template = template.get("default")
        if not template and "<start_of_turn>" in tok.get_added_vocab():
            # Gemma GGUF files may carry no template (the Gemma 3 270M one does not); its turn
            # format is fixed by the vocabulary, as llama.cpp also assumes.
            template = GEMMA_CHAT_TEMPLATE
        self.chat_template: str | None = template or None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Special-token text in `text` ("<|im_start|>") maps to its id: rendered chat templates
        # rely on that.
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
        )

    def token_bytes(self, token_id: int) -> bytes | None:
        return None  # byte-level BPE pieces are not raw bytes: decode them instead

    def incremental_decoder(self) -> None:
        return None


def end_token_ids(tok: Any, declared: Iterable[int | None]) -> tuple[int, ...]:
    """EOS ids for generation: the checkpoint's declared ones first, then known end tokens.

    `declared`: EOS ids from config.json / generation_config.json / GGUF metadata, in that order.
    """
    # get_added_vocab: special and added tokens, text -> id
    return end_ids(declared, tok.eos_token_id, tok.get_added_vocab())


def end_ids(
    declared: Iterable[int | None], eos_token_id: int | None, added: Mapping[str, int]
) -> tuple[int, ...]:
    """`end_token_ids` for any tokenizer: the declared ids, its EOS, then the known end tokens
    among its added (special) tokens `added` (text -> id)."""
    ids: list[int] = [int(i) for i in declared if i is not None]
    if eos_token_id is not None:
        ids.append(eos_token_id)
    ids.extend(added[text] for text in END_TOKENS if text in added)
    if all(t in added for t in HARMONY_TURN_ENDS) and HARMONY_MESSAGE_END in added:
        ids = [i for i in ids if i != added[HARMONY_MESSAGE_END]]
    return tuple(dict.fromkeys(ids))  # dedupe, keep order


def _auto_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_hf_tokenizer(directory: Path) -> Any:
    """The transformers tokenizer of a model directory (tokenizer.json / tokenizer_config.json)."""
    try:
        return _auto_tokenizer().from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError...)
        raise ModelLoadError(f"cannot load the tokenizer of {directory}: {e}") from e


def _gguf_cache_dir(path: Path) -> Path:
    # Keyed by content, not path or mtime (an image layer rounds mtimes, so a cache baked into a
    # Docker image would never match): the size, a SHA-256 of the first 16 MiB, which hold the
    # GGUF header and all its metadata, tokenizer included (1.7 MB for SmolLM2, ~10 MB for the
    # largest vocabularies), and the transformers version that converted it. ~0.06 s, any size.
    version = importlib.metadata.version("transformers")  # without importing it (~45 MiB)
    h = hashlib.sha256(f"{path.stat().st_size}|{version}|".encode())
    with path.open("rb") as f:
        h.update(f.read(16 << 20))
    digest = h.hexdigest()[:16]
    return model_dir() / "tokenizers" / f"{path.stem}-{digest}"


# GGUF architectures transformers does not read, whose tokenizer it converts as another's:
# SmolLM3's, LFM2-MoE's and Granite 4.0-H's are byte-level BPEs as Llama 3's (the split rule
# comes from tokenizer.ggml.pre either way).
# gpt-oss's it reads, but its reader of the gpt-oss.rope.scaling.* keys (which every gpt-oss file
# has) takes each field's first part, the key's length, for the value and fails: the tokenizer is
# a byte-level BPE like any other. Gemma 4's config reader refuses its per-layer FFN widths (an
# array), and its tokenizer is Gemma 3's class either way (the builder follows
# tokenizer.ggml.model).
GGUF_TOKENIZER_ALIASES = {
    "smollm3": "llama", "gpt-oss": "llama", "gemma4": "gemma3", "lfm2moe": "llama",
    "granitehybrid": "llama",
}  # fmt: skip


def load_gguf_tokenizer(path: Path) -> Any:
    """The transformers tokenizer stored in a GGUF file's metadata.

    Converting it takes 3-4 s (transformers parses the whole GGUF header and builds the BPE); the
    result is saved once in the model cache and later loads read it back in ~0.2 s. If the cache
    is not writable the conversion is simply redone each time.
    """
    path = Path(path)
    cache = _gguf_cache_dir(path)
    auto = _auto_tokenizer()
    if (cache / "tokenizer.json").is_file():
        try:
            return auto.from_pretrained(str(cache), local_files_only=True)
        except Exception:  # a damaged cache entry: convert again below and replace it
            shutil.rmtree(cache, ignore_errors=True)
    from models.gguf_reader import transformers_reads_fast

    try:
        with transformers_reads_fast(GGUF_TOKENIZER_ALIASES):
            tok = auto.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot read the tokenizer stored in {path}: {e}") from e
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the model
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cache)  # atomic: a concurrent loader sees all of it or nothing
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    return tok


def load_gguf_bpe_tokenizer(path: Path, declared: Iterable[int | None]) -> Any:
    """A GGUF file's converted tokenizer as a `models.saved_tokenizer.SavedTokenizer`, with its
    end-of-generation ids (`declared` first): the server process does not import transformers.

    The first load of a file converts it in a child process that saves the result in the
    model cache (`python -m models.hf_tokenizer FILE`); where the cache cannot be written, the
    conversion runs here and transformers' tokenizer is used (`HFTokenizer`)."""
    path = Path(path)
    cache = _gguf_cache_dir(path)
    if not (cache / "tokenizer.json").is_file():
        root = str(Path(__file__).resolve().parent.parent)  # this checkout, for `-m models...`
        paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        # a failed conversion is redone here, below, where its error reaches the caller
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                [sys.executable, "-m", "models.hf_tokenizer", str(path)],
                env=env,
                capture_output=True,
                check=False,
                timeout=600,
            )
    if (cache / "tokenizer.json").is_file():
        try:
            tok = SavedTokenizer(cache)
        except Exception as e:  # tokenizers raises a plain Exception on a file it cannot read
            shutil.rmtree(cache, ignore_errors=True)  # damaged: converted again next time
            raise ModelLoadError(f"cannot read the tokenizer saved for {path}: {e}") from e
        tok.eos_token_ids = end_ids(declared, tok.eos_token_id, tok.added_vocab)
        return tok
    hf = load_gguf_tokenizer(path)
    return HFTokenizer(hf, end_token_ids(hf, declared))


if __name__ == "__main__":  # the child process of load_gguf_bpe_tokenizer: convert and save
    load_gguf_tokenizer(Path(sys.argv[1]))
