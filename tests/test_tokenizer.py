"""Tokenizers and incremental detokenization.

The byte tokenizer (TinyGPT) and the real SmolLM2 tokenizer (byte-level BPE, converted by
transformers from the fetched GGUF file; `python -m models.fetch` must have run). The incremental
detokenizer must reproduce a full decode exactly, delta by delta, and never emit half a character.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

import random
from pathlib import Path

import pytest
from gguf import GGUFWriter

from models import ByteTokenizer, IncrementalDetokenizer, Tokenizer
from models.hf_tokenizer import HFTokenizer, end_token_ids, load_gguf_tokenizer

MIXED_TEXT = (
    "Hello, world! Crème brûlée à Paris — naïve café. 東京の天気は晴れです。 🐙🚀👩‍💻 done."
)


def stream(
    tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, step: int = 1
) -> list[str]:
    """Deltas of feeding `ids` `step` at a time, then the flush."""
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.fixture(scope="module")
def smol_tok(smollm2_file) -> HFTokenizer:
    hf = load_gguf_tokenizer(smollm2_file)
    return HFTokenizer(hf, end_token_ids(hf, [2]))


# -- byte tokenizer -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8_and_adds_bos_on_request():
    tok = ByteTokenizer()
    ids = tok.encode(MIXED_TEXT)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == MIXED_TEXT
    assert tok.encode("a", add_special_tokens=True) == [tok.BOS, ord("a")]
    assert tok.decode([tok.BOS, ord("a"), tok.EOS]) == "a"


def test_incremental_detokenizer_never_splits_a_character_of_byte_ids():
    tok = ByteTokenizer()
    ids = tok.encode(MIXED_TEXT)
    deltas = stream(tok, ids)
    assert "".join(deltas) == MIXED_TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 10  # multi-byte characters were held back, then emitted whole


# -- SmolLM2's tokenizer --------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tokenizer_implements_the_protocol(smol_tok):
    assert isinstance(smol_tok, Tokenizer)
    assert smol_tok.vocab_size == 49152
    assert smol_tok.bos_token_id == 1
    assert smol_tok.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    text = smol_tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = smol_tok.encode(text)
    assert ids.count(1) == 3  # each <|im_start|> in the rendered text is one special id
    assert (
        smol_tok.decode(ids)
        == "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\nuser\nHi\nassistant\n"
    )


@pytest.mark.slow
def test_smollm2_splits_characters_across_ids(smol_tok):
    # The premise of the next tests: some ids are pieces of a character (byte-level BPE).
    ids = smol_tok.encode(MIXED_TEXT)
    assert any("\ufffd" in smol_tok.decode([i]) for i in ids)


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenizer_matches_full_decode_with_smollm2(smol_tok, step):
    ids = smol_tok.encode(MIXED_TEXT)
    deltas = stream(smol_tok, ids, step=step)
    assert "".join(deltas) == smol_tok.decode(ids) == MIXED_TEXT
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_incremental_detokenizer_continues_a_prompt_with_smollm2(smol_tok):
    prompt = smol_tok.encode(smol_tok.apply_chat_template([{"role": "user", "content": "Say hi"}]))
    generated = smol_tok.encode(" Bonjour 👋, ça va? 日本語もOK.<|im_end|>")
    deltas = stream(smol_tok, generated, prompt=prompt)
    full = smol_tok.decode(prompt + generated)
    assert (
        "".join(deltas) == full[len(smol_tok.decode(prompt)) :] == " Bonjour 👋, ça va? 日本語もOK."
    )
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_incremental_detokenizer_matches_full_decode_on_random_ids(smol_tok):
    # Random ids make invalid UTF-8 too: the deltas must still add up to the full decode.
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(17, smol_tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(smol_tok, ids)) == smol_tok.decode(ids)


def write_tokenizer_gguf(path: Path) -> Path:
    """A GGUF file holding only a small byte-level BPE tokenizer and a chat template."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "Ġth", "Ġthe"]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(["Ġ t", "Ġt h", "Ġth e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_tokenizer_conversion_is_cached(tmp_path, monkeypatch):
    """The second load reads the saved conversion instead of converting the GGUF again."""
    import transformers

    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path / "cache"))
    path = write_tokenizer_gguf(tmp_path / "tok.gguf")
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        calls.append("gguf_file" in kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    first = load_gguf_tokenizer(path)
    second = load_gguf_tokenizer(path)
    assert calls == [True, False]  # converted once, then read from the cache
    assert list((tmp_path / "cache" / "tokenizers").iterdir())
    assert first.encode(" the 🐙") == second.encode(" the 🐙")
    assert second.chat_template == first.chat_template is not None
