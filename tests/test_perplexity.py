"""tools.perplexity against an independent computation: transformers' own model of a tiny random
config (tests/helpers/tiny_archs.py's; nothing downloaded) scored the way
llama.cpp's llama-perplexity scores a text (chunks of n_ctx, BOS first, the second half scored).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

import pytest
import torch

from models import load_model
from tests.helpers.model_files import write_hf_checkpoint
from tests.helpers.tiny_archs import gemma3_config, qwen2_config
from tools import perplexity as ppl_tool

N_CTX = 32
TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump!"
)  # 125 byte-level tokens: three chunks of 32 and a remainder that is dropped


def reference_ppl(model, tokens: list[int], n_ctx: int, bos: int | None) -> tuple[float, int]:
    """(perplexity, tokens scored) from transformers' logits, chunk by chunk."""
    nll, count = 0.0, 0
    first = n_ctx // 2
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        ids = tokens[start : start + n_ctx]
        if bos is not None:
            ids[0] = bos
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].double()
        target = torch.tensor(ids[first + 1 :])
        loss = torch.nn.functional.cross_entropy(logits[first:-1], target, reduction="sum")
        nll += float(loss)
        count += len(target)
    return math.exp(nll / count), count


@pytest.fixture(scope="module", params=["gemma3", "qwen2"])
def tiny(request, tmp_path_factory):
    """(our model loaded from the HF directory, the transformers model that wrote it)."""
    config = {"gemma3": gemma3_config, "qwen2": qwen2_config}[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    ref = write_hf_checkpoint(path, config, seed=3)
    return load_model(str(path)), ref


@pytest.mark.parametrize("add_bos", [True, False])
def test_perplexity_matches_transformers_scored_as_llama_perplexity(tiny, add_bos):
    lm, ref = tiny
    tokens, _ = ppl_tool.tokenize(lm, TEXT)
    assert len(tokens) == len(TEXT) and len(tokens) // N_CTX == 3
    bos = lm.tokenizer.bos_token_id if add_bos else None
    want, count = reference_ppl(ref, list(tokens), N_CTX, bos)
    got = ppl_tool.perplexity(lm, tokens, N_CTX, add_bos)
    assert got.count == count == 3 * (N_CTX // 2 - 1)
    assert len(got.running) == 3 and got.running[-1] == got.ppl
    assert got.ppl == pytest.approx(want, rel=1e-4)
    # what is scored matters: the first half too, or the first token left as it is, is another figure
    other, _ = reference_ppl(ref, list(tokens), N_CTX, None if add_bos else 0)
    assert abs(other - want) > 1e-3 * want


def test_too_short_a_text_is_refused(tiny):
    lm, _ = tiny
    tokens, add_bos = ppl_tool.tokenize(lm, TEXT[:60])
    with pytest.raises(ValueError, match="at least 64 tokens"):
        ppl_tool.perplexity(lm, tokens, N_CTX, add_bos)


def test_cli_prints_chunks_and_the_final_estimate(tmp_path, capsys):
    model = tmp_path / "m"
    write_hf_checkpoint(model, qwen2_config(), seed=4)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert ppl_tool.main(["-m", str(model), "-f", str(text), "-c", str(N_CTX)]) == 0
    out = capsys.readouterr().out
    assert "[1]" in out and "[3]" in out and "[4]" not in out
    final = float(out.split("Final estimate: PPL = ")[1].split()[0])
    assert math.isfinite(final) and final > 1
    assert ppl_tool.main(["-m", str(model), "-f", str(text), "-c", "64"]) == 1
