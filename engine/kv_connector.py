"""Moving a request's KV cache between two block pools as a byte buffer.

Owns the wire format and the transfer counters, nothing about who moves when (that is
`engine.disaggregated`). A payload is self-describing so the same bytes could cross a process or a
machine boundary: a 4-byte big-endian header length, a JSON header (dtype, shape, token count),
then the raw K/V of whole blocks in every layer, laid out as `ModelRunner.read_blocks` returns
them: `(layers, 2, num_blocks, block_size, kv_heads, head_dim)`.

Whole blocks travel, the last one padding included: a block is the unit both pools allocate in,
so the receiver writes block for block without re-slicing tokens.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from engine.model_runner import ModelRunner

_LENGTH = struct.Struct(">I")  # header length prefix


@dataclass(frozen=True, slots=True)
class KVHeader:
    """What a payload carries: the dtype and shape of its blocks and how many tokens they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # (layers, 2, num_blocks, block_size, kv_heads, head_dim)
    num_tokens: int
    interleaved_keys: bool = False  # `KVLayout.interleaved_keys` of the pool they came from

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def pack_blocks(runner: ModelRunner, block_ids: list[int], num_tokens: int) -> bytes:
    """Serialize whole blocks of `runner`'s pool (the first `num_tokens` tokens live in them)."""
    if not block_ids:
        raise ValueError("nothing to pack: no blocks")
    blocks = runner.read_blocks(block_ids).contiguous()  # (L, 2, n, bs, kv, hd)
    header = {
        "dtype": str(blocks.dtype),
        "shape": list(blocks.shape),
        "num_tokens": num_tokens,
        "interleaved_keys": runner.model.config.kv_layout.interleaved_keys,
    }
    head = json.dumps(header).encode()
    # uint8 view: numpy has no bfloat16, and raw bytes are what a transport carries anyway.
    data = blocks.view(torch.uint8).numpy().tobytes()
    return _LENGTH.pack(len(head)) + head + data


def unpack_blocks(payload: bytes) -> tuple[KVHeader, torch.Tensor]:
    """The header and the blocks of a payload made by `pack_blocks`."""
    (head_len,) = _LENGTH.unpack_from(payload)
    raw = json.loads(payload[_LENGTH.size : _LENGTH.size + head_len])
    dtype = getattr(torch, raw["dtype"].removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KV payload has an unknown dtype {raw['dtype']!r}")
    header = KVHeader(
        dtype, tuple(raw["shape"]), raw["num_tokens"], bool(raw.get("interleaved_keys", False))
    )
    data = memoryview(payload)[_LENGTH.size + head_len :]
    if len(data) != header.nbytes:
        raise ValueError(f"KV payload holds {len(data)} bytes, its header says {header.nbytes}")
    # bytearray: torch.frombuffer wants a writable buffer, and the tensor must outlive `payload`.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (nbytes,)
    return header, flat.view(dtype).view(header.shape)  # (L, 2, n, bs, kv, hd)


class KVConnector:
    """Moves blocks between pools as `pack_blocks` bytes and counts what arrived.

    `send` runs on the side that computed the cache, `receive` on the side that continues from it;
    in process they meet directly, a remote connector would put a transport between them.
    `transferred_bytes` counts K/V bytes (whole blocks), not the few header bytes.
    """

    def __init__(self) -> None:
        self.transfers = 0
        self.transferred_bytes = 0

    def send(self, runner: ModelRunner, block_ids: list[int], num_tokens: int) -> bytes:
        return pack_blocks(runner, block_ids, num_tokens)

    def receive(self, payload: bytes, runner: ModelRunner, block_ids: list[int]) -> KVHeader:
        """Write a payload's blocks into `block_ids` of `runner`'s pool, block for block."""
        header, blocks = unpack_blocks(payload)
        want = runner.kv.shape
        if header.dtype != runner.kv.dtype or (
            header.shape[:2] + header.shape[3:] != want[:2] + want[3:]
        ):
            raise ValueError(
                f"KV payload of {header.dtype} {header.shape} does not fit a pool of "
                f"{runner.kv.dtype} {tuple(want)}"
            )
        ours = runner.model.config.kv_layout.interleaved_keys
        if header.interleaved_keys != ours:
            # (the same model loaded with other kernel options orders its keys otherwise: its
            # attention would read these keys permuted)
            order = {False: "Hugging Face's", True: "GGML's"}
            raise ValueError(
                f"KV payload's keys are in {order[header.interleaved_keys]} order, this pool's in "
                f"{order[ours]}"
            )
        if len(block_ids) != header.num_blocks:
            raise ValueError(f"{header.num_blocks} blocks sent, {len(block_ids)} to receive them")
        runner.write_blocks(block_ids, blocks)
        self.transfers += 1
        self.transferred_bytes += header.nbytes
        return header
