"""Moving a request's KV cache between two block pools as a byte buffer.

Owns the wire format and the transfer counters, nothing about who moves when (that is
`engine.disaggregated`). A payload is self-describing so the same bytes could cross a process or a
machine boundary: a 4-byte big-endian header length, a JSON header (dtype, shape, token count),
then the raw K/V of whole blocks in every layer, laid out as `ModelRunner.read_blocks` returns
them: `(layers, 2, num_blocks, block_size, kv_heads, head_dim)`. A hybrid model's request also
carries its recurrent state (the state after the same tokens: `ModelRunner.read_state`'s conv
histories then states, float32, their shapes in the header), which the receiver writes into the
request's live state slot.

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
    # a hybrid model's recurrent state after the same tokens: (layers, K - 1, channels) conv
    # histories and (layers, *state) states, float32; None: no recurrent layers
    conv_shape: tuple[int, ...] | None = None
    ssm_shape: tuple[int, ...] | None = None

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of K/V."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def state_nbytes(self) -> int:
        if self.conv_shape is None or self.ssm_shape is None:
            return 0
        return 4 * (math.prod(self.conv_shape) + math.prod(self.ssm_shape))


RecurrentState = tuple[torch.Tensor, torch.Tensor]  # (conv histories, states), every layer


def pack_blocks(
    runner: ModelRunner, block_ids: list[int], num_tokens: int, state_slot: int | None = None
) -> bytes:
    """Serialize whole blocks of `runner`'s pool (the first `num_tokens` tokens live in them),
    and for a hybrid model the request's recurrent state from `state_slot`."""
    if not block_ids:
        raise ValueError("nothing to pack: no blocks")
    blocks = runner.read_blocks(block_ids).contiguous()  # (L, 2, n, bs, kv, hd)
    header = {
        "dtype": str(blocks.dtype),
        "shape": list(blocks.shape),
        "num_tokens": num_tokens,
        "interleaved_keys": runner.model.config.kv_layout.interleaved_keys,
    }
    state: list[torch.Tensor] = []
    if runner.states is not None:
        if state_slot is None:
            raise ValueError("a hybrid model's request moves with its recurrent state slot")
        state = [t.contiguous() for t in runner.read_state(state_slot)]
        header["conv_shape"], header["ssm_shape"] = list(state[0].shape), list(state[1].shape)
    head = json.dumps(header).encode()
    # uint8 view: numpy has no bfloat16, and raw bytes are what a transport carries anyway.
    data = blocks.view(torch.uint8).numpy().tobytes()
    data += b"".join(t.numpy().tobytes() for t in state)  # (float32; LFM2's ssm part is empty)
    return _LENGTH.pack(len(head)) + head + data


def unpack_blocks(payload: bytes) -> tuple[KVHeader, torch.Tensor]:
    """The header and the blocks of a payload made by `pack_blocks`."""
    header, blocks, _ = unpack_payload(payload)
    return header, blocks


def unpack_payload(payload: bytes) -> tuple[KVHeader, torch.Tensor, RecurrentState | None]:
    """The header, the blocks and (a hybrid model's) the recurrent state of a payload."""
    (head_len,) = _LENGTH.unpack_from(payload)
    raw = json.loads(payload[_LENGTH.size : _LENGTH.size + head_len])
    dtype = getattr(torch, raw["dtype"].removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KV payload has an unknown dtype {raw['dtype']!r}")
    conv, ssm = raw.get("conv_shape"), raw.get("ssm_shape")
    header = KVHeader(
        dtype,
        tuple(raw["shape"]),
        raw["num_tokens"],
        bool(raw.get("interleaved_keys", False)),
        None if conv is None else tuple(conv),
        None if ssm is None else tuple(ssm),
    )
    data = memoryview(payload)[_LENGTH.size + head_len :]
    if len(data) != header.nbytes + header.state_nbytes:
        raise ValueError(
            f"KV payload holds {len(data)} bytes, its header says "
            f"{header.nbytes + header.state_nbytes}"
        )
    # bytearray: torch.frombuffer wants a writable buffer, and the tensor must outlive `payload`.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (nbytes,)
    blocks = flat[: header.nbytes].view(dtype).view(header.shape)  # (L, 2, n, bs, kv, hd)
    state = None
    if header.conv_shape is not None and header.ssm_shape is not None:
        floats = flat[header.nbytes :].view(torch.float32)
        split = math.prod(header.conv_shape)
        state = (floats[:split].view(header.conv_shape), floats[split:].view(header.ssm_shape))
    return header, blocks, state


class KVConnector:
    """Moves blocks between pools as `pack_blocks` bytes and counts what arrived.

    `send` runs on the side that computed the cache, `receive` on the side that continues from it;
    in process they meet directly, a remote connector would put a transport between them.
    `transferred_bytes` counts K/V bytes (whole blocks), not the few header bytes.
    """

    def __init__(self) -> None:
        self.transfers = 0
        self.transferred_bytes = 0

    def send(
        self,
        runner: ModelRunner,
        block_ids: list[int],
        num_tokens: int,
        state_slot: int | None = None,
    ) -> bytes:
        return pack_blocks(runner, block_ids, num_tokens, state_slot)

    def receive(
        self,
        payload: bytes,
        runner: ModelRunner,
        block_ids: list[int],
        state_slot: int | None = None,
    ) -> KVHeader:
        """Write a payload's blocks into `block_ids` of `runner`'s pool, block for block, and
        a hybrid model's recurrent state into `state_slot`."""
        header, blocks, state = unpack_payload(payload)
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
        if (state is None) != (runner.states is None):
            raise ValueError(
                "KV payload "
                + (
                    "carries a recurrent state"
                    if state is not None
                    else "lacks the recurrent state"
                )
                + " this pool's model "
                + ("does not keep" if runner.states is None else "needs")
            )
        if state is not None:
            want_conv, want_ssm = runner.conv_states[:, 0].shape, runner.ssm_states[:, 0].shape
            if state[0].shape != want_conv or state[1].shape != want_ssm:
                raise ValueError(
                    f"KV payload's recurrent state {tuple(state[0].shape)} + "
                    f"{tuple(state[1].shape)} does not fit this model's {tuple(want_conv)} + "
                    f"{tuple(want_ssm)}"
                )
            if state_slot is None:
                raise ValueError("a hybrid model's request is received into a state slot")
            runner.write_state(state_slot, *state)
        runner.write_blocks(block_ids, blocks)
        self.transfers += 1
        self.transferred_bytes += header.nbytes + header.state_nbytes
        return header
