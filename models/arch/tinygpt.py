"""TinyGPT: the reference configuration of the continuous-batching chapter's measurements (random
weights, seed 0), the model its workload and figures were taken with; built in, loaded by name.

5,838,080 parameters: vocab 260 (bytes + BOS/EOS/PAD), 6 layers, d_model 256, 8 query heads,
2 KV heads, head_dim 32, SwiGLU hidden 1024, RoPE theta 10000, RMSNorm eps 1e-5, untied head,
context 2048, fp32, the Llama decoder. Its outputs are gibberish; it exists so that tests and
benchmarks exercise the whole serving path in milliseconds.
"""

from __future__ import annotations

import torch

from models.arch.spec import ArchSpec
from models.base import LoadedModel
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.tokenizer import ByteTokenizer

TINYGPT_CONFIG = ModelConfig(
    name="tinygpt",
    vocab_size=260,
    hidden_size=256,
    num_layers=6,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=1024,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=ByteTokenizer.BOS,
    eos_token_ids=(ByteTokenizer.EOS,),
    pad_token_id=ByteTokenizer.PAD,
    dtype=torch.float32,
)


def build_tinygpt() -> tuple[LlamaForCausalLM, ByteTokenizer]:
    # fork_rng: building the reference model must not reseed the caller's global generator.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(TINYGPT_CONFIG)
    model.eval().requires_grad_(False)
    return model, ByteTokenizer(TINYGPT_CONFIG.vocab_size)


def load_tinygpt() -> LoadedModel:
    model, tok = build_tinygpt()
    return LoadedModel("tinygpt", model, tok, model.config)


SPECS = (
    ArchSpec(
        name="tinygpt",
        model_class=LlamaForCausalLM,
        describes="the built-in reference model",
        builtin=load_tinygpt,
    ),
)
