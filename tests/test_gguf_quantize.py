"""models.gguf_quantize against two other implementations: the `gguf` package and llama-quantize.

In CI: each format's blocks decode through `gguf`'s own `dequantize` to the input within the
format's error; the 32-value formats are byte for byte what `gguf`'s own quantizers write (which
mirror llama.cpp's reference); the K_M mix gives the tensor types a real llama-quantize file has,
and the IQ4 mixes follow llama-quantize's rules for them.
Where llama.cpp is built (`LLAMA_CPP_BIN`, else the peers' build folder): a random F32 / F16 model
quantized by `llama-quantize` to each type has our bytes, tensor by tensor.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from models.gguf_quantize import FORMATS, FTYPES, mix_types, quantize
from tests.helpers.llama_cpp import llama_cpp_tool

Q = GGMLQuantizationType

# Relative RMS error each format stays within on Gaussian weights (its step is 1/7 .. 1/127 of a
# block's range): a wrong scale, a swapped nibble or a lost high bit is far above these.
RMS_BOUND = {
    Q.Q8_0: 0.01,
    Q.Q6_K: 0.025,
    Q.Q5_0: 0.06,
    Q.Q5_1: 0.06,
    Q.Q5_K: 0.05,
    Q.Q4_0: 0.12,
    Q.Q4_1: 0.12,
    Q.Q4_K: 0.1,
    Q.IQ4_NL: 0.1,  # 16 levels, denser near zero, per 32 values
    Q.IQ4_XS: 0.1,  # the same levels, the 32-value scales in 6 bits of a 256-value one
    # E2M1's 8 magnitudes (0 .. 6, coarser than 4-bit integers at the top) under a power-of-two
    # scale per 32 values, which can leave up to half of the block's range unused
    Q.MXFP4: 0.15,
}


def awkward_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Weights as a model has them, plus the blocks that take the quantizers' edge paths."""
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x[0] = 0  # all-zero blocks and super-blocks
    x[1] = 0.25  # constant (max == min)
    x[2] = np.abs(x[2])  # no negative value (the K-quants' min clamps at 0)
    x[3] = -np.abs(x[3])
    x[4, ::37] = 1.5  # outliers
    x[5, :16] = 0  # a zero 16-value sub-block in a Q6_K super-block
    x[6] = rng.integers(-3, 4, cols).astype(np.float32) * 0.01  # few levels, many ties
    return x


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_blocks_decode_through_gguf_within_the_formats_error(qtype):
    rng = np.random.default_rng(int(qtype))
    x = awkward_rows(rng, 24, 512)
    q = quantize(x, qtype)
    block, nbytes = GGML_QUANT_SIZES[qtype]
    assert q.dtype == np.uint8 and q.shape == (24, 512 // block * nbytes)
    y = dequantize(q, qtype)
    assert y.shape == x.shape
    assert np.all(y[0] == 0)
    normal = slice(7, None)
    rel = np.linalg.norm(y[normal] - x[normal]) / np.linalg.norm(x[normal])
    assert rel < RMS_BOUND[qtype]
    # Per row, the error is within one quantization step of the row's range (MXFP4's top step is
    # 2 of E2M1's units, and its power-of-two unit can be a quarter of the row's largest value).
    step = 0.25 if qtype == Q.MXFP4 else 0.15
    for row in range(1, 7):
        span = float(x[row].max() - min(0.0, float(x[row].min())))
        assert np.abs(y[row] - x[row]).max() <= span * step + 1e-6, row
    # The constant row comes back (nearly) constant.
    assert np.abs(y[1] - 0.25).max() < 0.25 * 0.07


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda t: t.name)
def test_32_value_formats_are_byte_identical_to_gguf_own_quantizers(qtype):
    rng = np.random.default_rng(7)
    x = awkward_rows(rng, 64, 1024)
    assert np.array_equal(quantize(x, qtype), gguf_quantize(x, qtype))


def test_bad_shapes_and_formats_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 320), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 320), np.float32), Q.IQ4_XS)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), Q.IQ4_NL)
    with pytest.raises(ValueError, match="no reference quantizer"):
        quantize(np.zeros((2, 256), np.float32), Q.IQ2_XXS)


def _gemma_270m_like_tensors() -> dict:
    """Gemma 3 270M's tensor names and shapes (d 640, 18 layers, ffn 2048, 4 x 256 query, 1 x 256
    KV heads, tied 262,144-token embedding): the published Q4_K_M file of it has Q8_0 (10),
    Q5_0 (81), Q4_K (27), Q6_K (9) and F32 (109) tensors."""
    d, ffn, q, kv = 640, 2048, 1024, 256
    shapes = {"token_embd.weight": (262144, d), "output_norm.weight": (d,)}
    for i in range(18):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_q.weight": (q, d),
            b + "attn_k.weight": (kv, d),
            b + "attn_v.weight": (kv, d),
            b + "attn_output.weight": (d, q),
            b + "ffn_gate.weight": (ffn, d),
            b + "ffn_up.weight": (ffn, d),
            b + "ffn_down.weight": (d, ffn),
        }
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            shapes[b + norm + ".weight"] = (d,)
        shapes[b + "attn_q_norm.weight"] = (256,)
        shapes[b + "attn_k_norm.weight"] = (256,)
    return {n: (s, Q.F32 if len(s) == 1 else Q.BF16) for n, s in shapes.items()}


def test_q4_k_m_mix_matches_the_published_gemma_3_270m_file():
    types = mix_types(_gemma_270m_like_tensors(), "Q4_K_M")
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    assert counts == {"Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "F32": 109}
    assert types["token_embd.weight"] == Q.Q8_0  # tied head, 640 not a multiple of 256
    # attn_v of layers 0, 1 (< n/8), 4, 7, 10, 13 ((i - 2) % 3 == 2) and 15, 16, 17 (>= 7n/8)
    # go up to Q6_K, whose 256-blocks do not fit 640: Q8_0; the rest Q4_K -> Q5_0.
    more = {0, 1, 4, 7, 10, 13, 15, 16, 17}
    for i in range(18):
        assert types[f"blk.{i}.attn_v.weight"] == (Q.Q8_0 if i in more else Q.Q5_0)
        assert types[f"blk.{i}.ffn_down.weight"] == (Q.Q6_K if i in more else Q.Q4_K)
        assert types[f"blk.{i}.attn_q.weight"] == Q.Q5_0


def test_iq4_mixes_for_the_gemma_3_270m_shape():
    tensors = _gemma_270m_like_tensors()
    xs = mix_types(tensors, "IQ4_XS")
    nl = mix_types(tensors, "IQ4_NL")
    # The tied head: Q6_K, whose 256-blocks do not fit 640: Q8_0.
    assert xs["token_embd.weight"] == nl["token_embd.weight"] == Q.Q8_0
    for i in range(18):
        b = f"blk.{i}."
        # 640-value rows: IQ4_XS falls back to IQ4_NL; attn_v (4 query heads a KV head) goes up
        # to Q5_K, and 640 takes it to Q5_1.
        assert xs[b + "attn_q.weight"] == nl[b + "attn_q.weight"] == Q.IQ4_NL
        assert xs[b + "ffn_up.weight"] == Q.IQ4_NL
        assert xs[b + "attn_v.weight"] == nl[b + "attn_v.weight"] == Q.Q5_1
        # ffn_down's 2048-value rows: the first 18 // 8 layers in Q5_K.
        assert xs[b + "ffn_down.weight"] == (Q.Q5_K if i < 2 else Q.IQ4_XS)
        assert nl[b + "ffn_down.weight"] == (Q.Q5_K if i < 2 else Q.IQ4_NL)
    # Fewer than four query heads a KV head: attn_v keeps the file's format.
    assert mix_types(tensors, "IQ4_XS", n_gqa=2)["blk.0.attn_v.weight"] == Q.IQ4_NL


def test_mixes_for_an_untied_llama_shape():
    shapes = {"token_embd.weight": (1000, 512), "output.weight": (1000, 512)}
    for i in range(8):
        shapes |= {f"blk.{i}.attn_v.weight": (128, 512), f"blk.{i}.ffn_down.weight": (512, 1536)}
        shapes |= {f"blk.{i}.attn_norm.weight": (512,), f"blk.{i}.attn_q.weight": (512, 512)}
    tensors = {n: (s, Q.F16 if len(s) == 2 else Q.F32) for n, s in shapes.items()}
    k_m = mix_types(tensors, "Q5_K_M")
    assert k_m["output.weight"] == Q.Q6_K and k_m["token_embd.weight"] == Q.Q5_K
    assert [k_m[f"blk.{i}.attn_v.weight"] == Q.Q6_K for i in range(8)] == [
        True, False, False, True, False, False, True, True,
    ]  # fmt: skip
    assert k_m["blk.0.attn_norm.weight"] == Q.F32
    q4_0 = mix_types(tensors, "Q4_0")
    assert q4_0["output.weight"] == Q.Q6_K and q4_0["blk.3.attn_v.weight"] == Q.Q4_0
    assert mix_types(tensors, "Q8_0")["output.weight"] == Q.Q8_0
    assert mix_types(tensors, "F16")["blk.0.attn_q.weight"] == Q.F16
    iq4 = mix_types(tensors, "IQ4_XS", n_gqa=4)  # no attn_k to tell the heads from
    assert iq4["output.weight"] == Q.Q6_K and iq4["token_embd.weight"] == Q.IQ4_XS
    assert iq4["blk.5.attn_v.weight"] == Q.Q5_K and iq4["blk.5.attn_q.weight"] == Q.IQ4_XS
    assert [iq4[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [Q.Q5_K, Q.IQ4_XS, Q.IQ4_XS]
    with pytest.raises(ValueError, match="unknown file type"):
        mix_types(tensors, "Q4_K_X")


# -- byte identity with llama-quantize (where llama.cpp is built) ----------------------------------


def write_random_llama(path: Path, float_type: GGMLQuantizationType) -> dict[str, np.ndarray]:
    """A 4-layer llama-architecture GGUF of random weights (tied embedding; ffn 352, so
    ffn_down's rows take the 32-value fallbacks). Returns the float32 values as written."""
    rng = np.random.default_rng(24)
    d, kv, ffn, vocab, layers = 256, 64, 352, 320, 4
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(int(FTYPES["F32" if float_type == Q.F32 else "F16"][0]))
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (d,),
            b + "attn_q.weight": (d, d),
            b + "attn_k.weight": (kv, d),
            b + "attn_v.weight": (kv, d),
            b + "attn_output.weight": (d, d),
            b + "ffn_norm.weight": (d,),
            b + "ffn_gate.weight": (ffn, d),
            b + "ffn_up.weight": (ffn, d),
            b + "ffn_down.weight": (d, ffn),
        }
    values = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            x = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, x)
        else:
            x = awkward_rows(rng, *shape)
            if float_type == Q.F16:
                x = x.astype(np.float16).astype(np.float32)
                w.add_tensor(name, x.astype(np.float16))
            else:
                w.add_tensor(name, x)
        values[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


@pytest.mark.slow
@pytest.mark.parametrize("float_type", [Q.F32, Q.F16], ids=lambda t: t.name)
def test_bytes_equal_llama_quantize(tmp_path, float_type):
    tool = llama_cpp_tool("llama-quantize")
    src = tmp_path / "in.gguf"
    values = write_random_llama(src, float_type)
    tensors = {n: (v.shape, float_type if v.ndim == 2 else Q.F32) for n, v in values.items()}
    ftypes = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K",
              "IQ4_NL", "IQ4_XS"]  # fmt: skip
    if float_type == Q.F16:
        ftypes = ["Q4_K_M", "Q5_0", "Q8_0"]  # the F16 input path; each format is covered above
    for ftype in ftypes:
        out = tmp_path / f"out-{ftype}.gguf"
        done = subprocess.run(
            [str(tool), str(src), str(out), ftype, "2"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        expected = mix_types(tensors, ftype)
        reader = GGUFReader(str(out))
        assert {t.name for t in reader.tensors} == set(values)
        for t in reader.tensors:
            assert t.tensor_type == expected[t.name], (ftype, t.name)
            if values[t.name].ndim == 1:
                continue
            ours = quantize(values[t.name], t.tensor_type).reshape(-1)
            theirs = np.asarray(t.data).view(np.uint8).reshape(-1)
            if not np.array_equal(ours, theirs):
                nbytes = GGML_QUANT_SIZES[t.tensor_type][1]
                first = int(np.flatnonzero(ours != theirs)[0]) // nbytes
                pytest.fail(f"{ftype} {t.name} ({t.tensor_type.name}): block {first} differs")


@pytest.mark.parametrize("n_expert", [8, 128])
def test_mixes_for_a_mixture_of_experts(n_expert):
    """Stacked experts mix as their dense names (ffn_down_exps as ffn_down), the router stays
    float32, and eight experts (llama-quantize's Mixtral case) lift attn_k / attn_v / attn_output.
    (The bytes against llama-quantize itself: tests/test_synth_model.py, where it is built.)"""
    shapes = {"token_embd.weight": (1000, 256), "output.weight": (1000, 256)}
    for i in range(8):
        b = f"blk.{i}."
        shapes |= {b + n: (256, 256) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")}
        shapes |= {b + "attn_output.weight": (256, 256), b + "ffn_gate_inp.weight": (n_expert, 256)}
        shapes |= {b + "ffn_gate_exps.weight": (n_expert, 512, 256)}
        shapes |= {b + "ffn_down_exps.weight": (n_expert, 256, 512)}
    tensors = {n: (s, Q.F32 if "gate_inp" in n else Q.F16) for n, s in shapes.items()}
    mix = mix_types(tensors, "Q4_K_M")
    eight = n_expert == 8
    assert mix["blk.2.ffn_gate_inp.weight"] == Q.F32 and mix["blk.2.ffn_gate_exps.weight"] == Q.Q4_K
    assert [mix[f"blk.{i}.ffn_down_exps.weight"] == Q.Q6_K for i in range(8)] == [
        True, False, False, True, False, False, True, True,
    ]  # fmt: skip
    assert mix["blk.1.attn_k.weight"] == (Q.Q8_0 if eight else Q.Q4_K)
    assert mix["blk.1.attn_v.weight"] == (Q.Q8_0 if eight else Q.Q4_K)
    assert mix["blk.1.attn_output.weight"] == (Q.Q5_K if eight else Q.Q4_K)
    assert mix["blk.1.attn_q.weight"] == Q.Q4_K
