"""Gemma's SentencePiece tokenizer (models.spm_tokenizer) against transformers' own GGUF conversion.

The oracle is transformers reading the same GGUF file (`AutoTokenizer.from_pretrained(...,
gguf_file=...)`, which derives a merges table and builds a `tokenizers` BPE): token ids, decoded
text and each token's bytes must agree. The files: a small synthetic Gemma 3 vocabulary with
every kind of token Gemma's has (control, user-defined, byte fallback, spaces stored as real
spaces, merges whose file order disagrees with their scores; tests/helpers/model_files.py), and
the real Gemma 3 270M vocabulary (fetched into the model cache if missing).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

import random
from pathlib import Path

import pytest

from models import IncrementalDetokenizer
from models.arch.readers import GGUFMeta
from models.gguf_loader import _open, load_gguf_file_tokenizer
from models.gguf_reader import GGUFHeaderReader, transformers_reads_fast
from models.spm_tokenizer import (
    SPMTokenizer,
    load_spm_tokenizer,
    read_gguf_tokenizer_metadata,
    uses_spm_tokenizer,
)
from tests.helpers.model_files import write_gemma_vocab_gguf
from tests.helpers.real_models import gemma3_270m_path

TEXTS = [
    "hello world",
    "the theatre, the ab aba baba abab.",
    "  leading and trailing   ",
    "Tab\tand\t\tnewlines\n\n\n\nend\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>the<eos><unused12><unused1>",
    "x</div>y<div><b>z</b>[multimodal]",
    "東京 and 京都 and 東 with ü, é and ö 🐙👩‍💻",
    "Thé hello!!! ??? ...",
    "\x00\x7f€",
    "box x y xx  x,x",  # "x\u2581" is a token: a merge across the start of a space run
    "",
    " ",
]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("abehlortwdx .,!\n\t<>/é東京ö🐙") + ["  ", "<start_of_turn>", "</div>", "aba"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def assert_same_as_transformers(ours: SPMTokenizer, hf, texts: list[str], seed: int) -> None:
    for text in texts:
        for special in (False, True):
            assert ours.encode(text, special) == hf.encode(text, add_special_tokens=special), text
    rng = random.Random(seed)
    for text in texts[:50]:
        ids = hf.encode(text, add_special_tokens=True)
        rng.shuffle(ids)  # byte tokens out of order: invalid UTF-8 runs decode as U+FFFD per byte
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from transformers import AutoTokenizer

    path = write_gemma_vocab_gguf(tmp_path_factory.mktemp("spm") / "gemma-vocab.gguf")
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, load_spm_tokenizer(path), hf


def test_token_ids_and_text_match_transformers_conversion(synthetic):
    _, ours, hf = synthetic
    assert ours.vocab_size == len(hf)
    assert_same_as_transformers(ours, hf, TEXTS + random_texts(400, seed=1), seed=2)
    # a few things the oracle comparison relies on actually happen in this vocabulary
    turn, para = hf.convert_tokens_to_ids(["<start_of_turn>", "\n\n"])
    assert ours.encode("<start_of_turn>\n\n") == [turn, para]
    assert ours.encode("  ")[0] == hf.convert_tokens_to_ids("\u2581\u2581")  # respelled spaces
    assert len(ours.encode("ö")) == 2  # not in the vocabulary: two byte tokens
    assert ours.encode("x", add_special_tokens=True)[0] == 2


def test_token_bytes_are_what_each_token_decodes_to(synthetic):
    _, ours, hf = synthetic
    for i in range(ours.vocab_size):
        raw = ours.token_bytes(i)
        piece = hf.convert_ids_to_tokens(i)
        if i in ours.special_ids:  # control tokens: no text in a decode that skips them
            assert raw == b"" and hf.decode([i], skip_special_tokens=True) == ""
        elif piece.startswith("<0x") and len(piece) == 6:
            assert raw == bytes([int(piece[3:5], 16)])
        else:
            assert raw.decode() == hf.decode([i], skip_special_tokens=False)
    assert ours.token_bytes(ours.vocab_size) == b"" and ours.token_bytes(-1) == b""


def test_streamed_text_is_the_full_decode(synthetic):
    _, ours, _ = synthetic
    ids = ours.encode("hello 東京 🐙 world\n\n<start_of_turn>ö")
    detok = IncrementalDetokenizer(ours, ids[:2])
    deltas = [detok.add([i]) for i in ids[2:]] + [detok.flush()]
    assert "".join(deltas) == ours.decode(ids[2:])
    assert all("\ufffd" not in d for d in deltas)  # a character split over byte tokens waits


def test_the_loader_picks_this_tokenizer_for_gemma_vocabularies_only(synthetic, tmp_path):
    path, _, _ = synthetic
    tok = load_gguf_file_tokenizer(path)
    assert isinstance(tok, SPMTokenizer)
    assert tok.eos_token_ids == (1, 7)  # <eos>, <end_of_turn>; not the HTML tag "</s>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    )
    meta = read_gguf_tokenizer_metadata(path)
    assert uses_spm_tokenizer(meta)
    assert not uses_spm_tokenizer(dict(meta, **{"general.architecture": "llama"}))
    assert not uses_spm_tokenizer(dict(meta, **{"tokenizer.ggml.model": "gpt2"}))


def test_the_loaders_reader_counts_the_tokenizer_arrays_and_parses_the_rest(synthetic):
    """The loader's GGUF reader leaves the tokenizer's arrays to the tokenizer (one ndarray per
    item in gguf's reader: ~330 MB for Gemma's); every other field is gguf's own parse."""
    from gguf import GGUFReader

    path, ours, _ = synthetic
    fast, full = _open(path), GGUFReader(str(path))
    arrays = {
        k for k in full.fields if k.startswith("tokenizer.ggml.") and len(full.fields[k].data) > 1
    }
    assert fast.array_lengths == {k: len(full.fields[k].data) for k in arrays}
    assert fast.array_lengths["tokenizer.ggml.tokens"] == ours.vocab_size
    assert set(fast.fields) == set(full.fields) - arrays
    for key, field in fast.fields.items():
        assert field.contents() == full.fields[key].contents(), key
    assert GGUFMeta(fast, path).array_len("tokenizer.ggml.tokens") == ours.vocab_size
    assert fast.data_offset == full.data_offset


def test_transformers_reading_with_the_fast_reader_converts_the_same_tokenizer(synthetic):
    """The tokenizer conversion's faster header parse (`transformers_reads_fast`) reads every field
    as gguf's own reader does and gives transformers' tokenizer, token for token; gguf is
    itself again afterwards."""
    import gguf
    from transformers import AutoTokenizer

    path, _, hf = synthetic
    fast, full = GGUFHeaderReader(path), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(full.fields)
    for key, field in fast.fields.items():
        assert field.contents() == full.fields[key].contents(), key
    with transformers_reads_fast():
        assert gguf.GGUFReader is GGUFHeaderReader
        converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert gguf.GGUFReader is not GGUFHeaderReader
    assert converted.get_vocab() == hf.get_vocab()
    for text in TEXTS:
        assert converted.encode(text) == hf.encode(text), text


def test_a_files_chat_template_gets_transformers_globals():
    """Gemma's instruction-tuned template writes `bos_token` and calls `raise_exception` when
    roles do not alternate (the server turns that error into a 400)."""
    import jinja2

    template = (
        "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 "
        "== 0) %}{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}"
        "{% endfor %}"
    )
    tok = SPMTokenizer(
        ["<pad>", "<eos>", "<bos>"], [3, 3, 3], bos_token_id=2, chat_template=template
    )
    user, model = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    assert tok.apply_chat_template([user, model]) == "<bos>ab"
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        tok.apply_chat_template([model])


def test_a_damaged_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_tokenizer_metadata(path)


# -- the real Gemma 3 270M vocabulary ------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_270m_vocabulary_matches_transformers_conversion():
    from models.hf_tokenizer import load_gguf_tokenizer

    path = gemma3_270m_path()
    ours, hf = load_spm_tokenizer(path), load_gguf_tokenizer(path)
    docs = [Path("README.md").read_text(), *(p.read_text() for p in Path("docs").glob("*.md"))]
    assert_same_as_transformers(ours, hf, docs + TEXTS + random_texts(300, seed=3), seed=4)
