"""Granite 4.0-H's own pieces (the model against transformers, through the engine, is
tests/test_models_hybrid.py's): the Mamba2 scan kernel against its pure-torch reference over a
step of decode rows and prefill chunks with snapshots, the scan in pieces across steps against transformers' chunked
SSD scan, the readers' refusals, the h-micro preset's state size."""

from __future__ import annotations

import pytest
import torch

from models import kernels
from models.arch.granite_hybrid import hf_granite_hybrid_fields
from models.base import ModelLoadError
from models.config import ModelConfig
from models.recurrent import mamba2_scan
from models.state import StateMetadata
from tools.synth_model import make_config


def _inputs(seed: int, t: int = 12, heads: int = 6, hd: int = 8, groups: int = 3, n: int = 16):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return dict(
        x=r(t, heads, hd),
        dt=r(t, heads),
        a=-(torch.rand(heads, generator=g) * 4 + 0.5),
        b=r(t, groups, n),
        c=r(t, groups, n),
        d=r(heads),
        dt_bias=r(heads),
    )


# a step: two decode rows (slots 3, 0), then a 6-token chunk (slot 1) snapshotting after 2 and
# 6 tokens into slots 4 and 5, then a 4-token chunk (slot 2)
SEQS = torch.tensor([[0, 1, 3], [1, 1, 0], [2, 6, 1], [8, 4, 2]])
SNAPSHOTS = torch.tensor([[2, 2, 4], [2, 6, 5]])


def test_mamba2_scan_kernel_matches_the_reference():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    args = _inputs(0)
    pool = torch.randn(6, 6, 8, 16, generator=torch.Generator().manual_seed(1))
    ref_pool, ker_pool = pool.clone(), pool.clone()
    state = StateMetadata(SEQS, SNAPSHOTS, [])
    want = mamba2_scan(**args, ssm_pool=ref_pool, state=state, use_kernel=False)
    got = mamba2_scan(**args, ssm_pool=ker_pool, state=state, use_kernel=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ker_pool, ref_pool, atol=1e-5, rtol=1e-5)
    assert not torch.equal(ref_pool[4], pool[4]) and not torch.equal(ref_pool[5], pool[5])


def test_the_scan_in_pieces_is_transformers_chunked_scan_in_one():
    """A 12-token sequence scanned as 5 + 1 + 6 tokens across steps (the state carried in its
    slot) gives transformers' chunked SSD scan of all 12 from the same start state."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

    args = _inputs(2)
    start = torch.randn(6, 8, 16, generator=torch.Generator().manual_seed(3))
    want, final = mamba2_chunk_scan(
        args["x"][None], args["dt"][None], args["a"], args["b"][None], args["c"][None],
        chunk_size=4, D=args["d"], dt_bias=args["dt_bias"], initial_states=start[None],
        dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    pool = start[None].clone()
    parts = []
    for s, n in ((0, 5), (5, 1), (6, 6)):
        piece = {k: v[s : s + n] if v.dim() > 1 else v for k, v in args.items()}
        state = StateMetadata(torch.tensor([[0, n, 0]]), torch.empty((0, 3), dtype=torch.long), [])
        parts.append(mamba2_scan(**piece, ssm_pool=pool, state=state))
    torch.testing.assert_close(torch.cat(parts), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[0], final[0], atol=1e-4, rtol=1e-4)


def _granite(**fields) -> dict:
    from tests.helpers.hybrid_configs import granite_hybrid_config

    return {**granite_hybrid_config().to_dict(), **fields}


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(num_local_experts=8), "mixture of experts"),
        (dict(mamba_proj_bias=True), "projection biases"),
        (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
        (dict(layer_types=["mamba", "cross", "mamba", "mamba"]), "layer_types"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(fields, words):
    with pytest.raises(ModelLoadError, match=words):
        hf_granite_hybrid_fields(_granite(**fields), "cfg")


def test_h_micro_preset_state_and_scalars():
    """granite-4.0-h-micro: 36 Mamba2 layers of conv history 3 x 4352 and state 64 x 64 x 128
    (77.4 MB a request, float32), 4 attention layers, no RoPE, Granite's multipliers."""
    _, cfg = make_config("granite-4.0-h-micro")
    c = ModelConfig(name="h-micro", **hf_granite_hybrid_fields(cfg, "preset"))
    layout = c.state_layout
    assert (layout.num_layers, layout.conv_shape, layout.ssm_shape) == (
        36,
        (3, 4352),
        (64, 64, 128),
    )
    assert layout.bytes_per_slot == 36 * (3 * 4352 + 64 * 64 * 128) * 4 == 77_377_536
    assert c.kv_layout.num_layers == 4 and c.recurrent.layers[:6] == (0, 1, 2, 3, 4, 6)
    assert all(c.nope_layers) and c.attention_scale == 0.015625 and c.logits_scaling == 8.0
