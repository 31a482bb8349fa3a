"""One rank's part of a KV hand-off, run on every rank of a gang through
`LLMEngine.collective_rpc` (so each rank ships only its own KV heads).

    prefill rank i:  pack its heads for each decode rank j ─▶ sender.send ─▶ poll
    decode rank j:   staging buffer per prefill rank i ─▶ receiver.expect ─▶ poll
                     ─▶ finish_receive: scatter the buffers into the paged blocks

A request's hand-off is one transfer id; it is split into one sub-transfer per
`kv_transfer_plan` entry (prefill rank, decode rank, head range), named
"<transfer id>/<plan index>", so a prefill gang of TP p and a decode gang of TP q
agree on the pieces without talking. Both sides copy through buffers (packed on
send, staged on receive): the paged blocks are never touched by the network, so
a request can be aborted, and its blocks reused, while a transfer is still in
flight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from cluster.transport.kv_transport import (
    KVReceiver,
    KVSender,
    PeerAddress,
    TransferState,
)
from engine.kv_head_map import kv_transfer_plan

SENDER, RECEIVER, SENDS, RECEIVES = "kv_sender", "kv_receiver", "kv_sends", "kv_receives"


@dataclass(slots=True)
class _Receive:
    sub_id: str
    sender_name: str
    buffer: torch.Tensor   # [layers, 2, num_blocks, block_size, num_heads, head_dim]
    local_heads: range     # where the heads go in this rank's cache


# ---- set-up (run once per rank) ----------------------------------------------------------
def attach_sender(worker, make_sender: Callable[[int, torch.device], KVSender]) -> str:
    """Creates this rank's sender (for buffers on the rank's device); returns its name."""
    sender = make_sender(worker.tp.rank, worker.device)
    worker.attachments.update({SENDER: sender, SENDS: {}})
    return sender.name


def attach_receiver(worker, make_receiver: Callable[[int, torch.device], KVReceiver]) -> PeerAddress:
    """Creates this rank's receiver (for buffers on the rank's device); returns the
    address senders connect to."""
    receiver = make_receiver(worker.tp.rank, worker.device)
    worker.attachments.update({RECEIVER: receiver, RECEIVES: {}})
    return receiver.address


def receiver_problem(worker) -> str | None:
    """Why this rank's receiver can take no new sender (None: it can, or there is none)."""
    receiver = worker.attachments.get(RECEIVER)
    return receiver.problem() if receiver is not None else None


def close_transport(worker) -> None:
    for key in (SENDER, RECEIVER):
        transport = worker.attachments.pop(key, None)
        if transport is not None:
            transport.close()


# ---- prefill side ---------------------------------------------------------------------------
def start_send(worker, transfer_id: str, block_ids: list[int], receivers: list[PeerAddress],
               num_kv_heads: int) -> int:
    """Packs this rank's heads of the blocks for every decode rank that needs
    them and queues the sends; returns the bytes queued."""
    sender: KVSender = worker.attachments[SENDER]
    rank, sub_ids, nbytes = worker.tp.rank, [], 0
    worker.attachments[SENDS][transfer_id] = sub_ids   # before the first send: a failure below forgets them
    try:
        for k, t in enumerate(kv_transfer_plan(num_kv_heads, worker.tp.size, len(receivers))):
            if t.src_rank != rank:
                continue
            heads = range(t.src_local_start, t.src_local_start + t.num_heads)
            packed = worker.kv_cache.read_blocks(block_ids, heads=heads)  # [L, 2, n, bs, heads, D]
            sub_id = f"{transfer_id}/{k}"
            sender.send(sub_id, receivers[t.dst_rank], packed)
            sub_ids.append(sub_id)
            nbytes += packed.numel() * packed.element_size()
    except BaseException:
        forget_transfer(worker, transfer_id)
        raise
    return nbytes


def packed_bytes_per_rank(num_blocks: int, head_block_bytes: int, num_kv_heads: int, src_tp: int,
                          dst_tp: int) -> int:
    """What `start_send` packs for `num_blocks` blocks on the prefill rank that
    packs most (`head_block_bytes`: one KV head of one block, K and V, all layers)."""
    return num_blocks * head_block_bytes * _most_heads_sent(num_kv_heads, src_tp, dst_tp)


@lru_cache(maxsize=64)
def _most_heads_sent(num_kv_heads: int, src_tp: int, dst_tp: int) -> int:
    """Heads one source rank packs per block, at most over the ranks (a head
    replicated on several decode ranks is packed once for each)."""
    heads = Counter()
    for t in kv_transfer_plan(num_kv_heads, src_tp, dst_tp):
        heads[t.src_rank] += t.num_heads
    return max(heads.values())


# ---- decode side ----------------------------------------------------------------------------
def start_receive(worker, transfer_id: str, num_blocks: int, sender_names: list[str],
                  num_kv_heads: int) -> int:
    """Posts a staging buffer for every piece this rank needs; returns their bytes."""
    receiver: KVReceiver = worker.attachments[RECEIVER]
    cache = worker.kv_cache
    spec = cache.spec
    rank, pieces, nbytes = worker.tp.rank, [], 0
    worker.attachments[RECEIVES][transfer_id] = pieces   # before the first expect: a failure below forgets them
    try:
        for k, t in enumerate(kv_transfer_plan(num_kv_heads, len(sender_names), worker.tp.size)):
            if t.dst_rank != rank:
                continue
            buffer = torch.empty(spec.num_layers, 2, num_blocks, spec.block_size, t.num_heads, spec.head_dim,
                                 dtype=spec.dtype, device=cache.tensor.device)
            piece = _Receive(f"{transfer_id}/{k}", sender_names[t.src_rank], buffer,
                             range(t.dst_local_start, t.dst_local_start + t.num_heads))
            receiver.expect(piece.sub_id, piece.sender_name, buffer)
            pieces.append(piece)
            nbytes += buffer.numel() * buffer.element_size()
    except BaseException:
        forget_transfer(worker, transfer_id)
        raise
    return nbytes


def finish_receive(worker, transfer_id: str, block_ids: list[int]) -> None:
    """Scatters the received pieces into the request's blocks and forgets them,
    every piece even when a write fails (its staging buffer would stay held)."""
    receiver: KVReceiver = worker.attachments[RECEIVER]
    pieces = worker.attachments[RECEIVES].pop(transfer_id)
    try:
        for piece in pieces:
            worker.kv_cache.write_blocks(block_ids, piece.buffer, heads=piece.local_heads)
    finally:
        for piece in pieces:
            receiver.forget(piece.sub_id, piece.sender_name)


# ---- both sides -------------------------------------------------------------------------------
def poll_transfers(worker, transfer_ids: list[str]) -> dict[str, tuple[TransferState, str | None]]:
    """This rank's state of each transfer: FAILED if any piece failed (with its
    error), DONE if all are done, else the least advanced state."""
    out = {}
    for tid in transfer_ids:
        states = []
        if tid in worker.attachments.get(SENDS, {}):
            sender: KVSender = worker.attachments[SENDER]
            states = [(sender.poll(s), sender.error(s)) for s in worker.attachments[SENDS][tid]]
        elif tid in worker.attachments.get(RECEIVES, {}):
            receiver: KVReceiver = worker.attachments[RECEIVER]
            states = [(receiver.poll(p.sub_id, p.sender_name), receiver.error(p.sub_id, p.sender_name))
                      for p in worker.attachments[RECEIVES][tid]]
        out[tid] = combine_states(states)
    return out


def forget_transfer(worker, transfer_id: str) -> None:
    """Drops the transfer on this rank (giving up on it if still in flight)."""
    for sub_id in worker.attachments.get(SENDS, {}).pop(transfer_id, []):
        worker.attachments[SENDER].forget(sub_id)
    for piece in worker.attachments.get(RECEIVES, {}).pop(transfer_id, []):
        worker.attachments[RECEIVER].forget(piece.sub_id, piece.sender_name)


def combine_states(states: list[tuple[TransferState, str | None]]) -> tuple[TransferState, str | None]:
    """One state for several pieces (or ranks). No pieces at all counts as DONE
    (a rank that holds none of the heads a peer needs)."""
    for state, error in states:
        if state is TransferState.FAILED:
            return state, error
    for state in (TransferState.PENDING, TransferState.TRANSFERRING):
        if any(s is state for s, _ in states):
            return state, None
    return TransferState.DONE, None
