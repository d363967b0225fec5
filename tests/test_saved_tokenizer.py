"""A GGUF file's BPE tokenizer served without transformers (models.saved_tokenizer), checked
against transformers' own tokenizer of the same file: ids, decoded text, special ids, the chat
template's rendering (with tools), and structured output's vocabulary."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from models.hf_tokenizer import load_gguf_bpe_tokenizer, load_gguf_tokenizer
from models.saved_tokenizer import SavedTokenizer
from models.tokenizer import render_chat_template

TEXTS = [
    "Hello world",
    " leading space and  double  spaces\tand a tab\n\nand lines",
    "Unicode: héllo wörld, 日本語のテキスト, emoji 🐙🦀, Ελληνικά, العربية",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-9",
    "",
    "   ",
    "'s 've n't 're ... !? ,,",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    return smollm2_file


@pytest.fixture(scope="module")
def pair(smollm2):
    """(ours, transformers') for SmolLM2's GGUF."""
    return load_gguf_bpe_tokenizer(smollm2, [2]), load_gguf_tokenizer(smollm2)


def test_the_gguf_tokenizer_is_served_from_the_saved_copy(pair):
    ours, _ = pair
    assert isinstance(ours, SavedTokenizer)


def test_encode_and_decode_equal_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (False, True):
                assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    # ids a model emits at random, byte-level fragments of characters included
    ids = list(range(0, 49152, 97)) + [0, 1, 2, 17, 250, 130]
    for skip in (False, True):
        assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_ids_and_vocabulary_equal_transformers(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert ours.added_vocab == hf.get_added_vocab()
    assert ours.eos_token_ids[0] == 2
    assert ours.chat_template == hf.chat_template


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'later' for a city: ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# A tool-calling template in the style of Qwen 2.5's: tojson with its keyword arguments, a loop
# control, the special-token names and raise_exception.
TOOL_TEMPLATE = textwrap.dedent(
    """\
    {{ bos_token }}{% if tools %}<tools>
    {% for t in tools %}{{ t | tojson }}
    {{ t['function']['parameters'] | tojson(indent=2) }}
    {% endfor %}</tools>
    {% endif %}{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no') }}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}<|im_start|>{{ m['role'] }}
    {{ m['content'] }}{{ eos_token }}
    {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
    {% endif %}"""
)


def test_chat_templates_render_as_transformers_renders_them(pair):
    ours, hf = pair
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich <today>?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": "Thanks"},
        {"role": "user", "content": "cut by the loop control"},
    ]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )
        assert render_chat_template(
            TOOL_TEMPLATE, messages, gen, tools=TOOLS, **ours.template_tokens()
        ) == hf.apply_chat_template(
            messages,
            tools=TOOLS,
            chat_template=TOOL_TEMPLATE,
            tokenize=False,
            add_generation_prompt=gen,
        )


def test_token_bytes_are_the_byte_level_pieces(pair):
    """Each token's raw bytes, joined, are transformers' decoding of the ids (byte-level pieces
    mapped back through GPT-2's alphabet); a special token has none."""
    ours, hf = pair
    special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert set(hf.all_special_ids) <= special
    assert all(ours.token_bytes(i) == b"" for i in special)
    plain = [i for i in range(ours.vocab_size) if i not in special]
    for start in range(0, len(plain), 4096):
        ids = plain[start : start + 4096]
        text = b"".join(ours.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        assert text == hf.decode(ids, clean_up_tokenization_spaces=False)
    assert ours.token_bytes(ours.vocab_size) == b""


def test_structured_output_vocabulary_from_the_saved_tokenizer(pair):
    """llguidance's vocabulary over our token bytes is the one llguidance reads from
    transformers' tokenizer itself: every token's bytes, which are special, and tokenization."""
    from engine.structured import _ll_tokenizer

    ours, hf = pair
    import llguidance.hf

    a = _ll_tokenizer(ours, ours.vocab_size)
    b = llguidance.hf.from_tokenizer(
        hf, n_vocab=ours.vocab_size, eos_token=list(ours.eos_token_ids)
    )
    assert a.vocab_size == b.vocab_size
    for i in range(ours.vocab_size):
        assert a.decode_bytes([i]) == b.decode_bytes([i]), i
        assert a.is_special_token(i) == b.is_special_token(i), i
    text = 'Hello {"a": [1, 2]} 日本'
    assert a.tokenize_str(text) == b.tokenize_str(text) == ours.encode(text)


def test_a_server_process_loading_a_gguf_does_not_import_transformers(smollm2, tmp_path):
    """The first load converts in a child process (the model cache is empty); neither the first
    nor a later load imports transformers where the server runs."""
    code = textwrap.dedent(
        f"""
        import sys
        from models.gguf_loader import load_gguf_file_tokenizer
        for _ in range(2):
            tok = load_gguf_file_tokenizer({str(smollm2)!r})
            print(type(tok).__name__, "transformers" in sys.modules, tok.encode("Hello world"))
        """
    )
    env = {"CBSERVE_MODEL_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == out[1] == "SavedTokenizer False [19556, 905]"
    assert list((tmp_path / "cache" / "tokenizers").iterdir())


def test_an_unwritable_cache_falls_back_to_transformers_in_process(smollm2, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tokenizers").write_text("not a directory")  # nothing can be saved under it
    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(cache))
    tok = load_gguf_bpe_tokenizer(smollm2, [2])
    assert type(tok).__name__ == "HFTokenizer"
    assert tok.encode("Hello world") == [19556, 905]
