"""The KV transport interface: one sender per prefill rank process, one receiver
per decode rank process, a poll-able state per transfer.

    sender:   send(tid, peer, buffer) ─▶ PENDING ─▶ TRANSFERRING ─▶ DONE | FAILED
    receiver: expect(tid, sender, buffer) ─▶ PENDING ─▶ TRANSFERRING ─▶ DONE | FAILED

A transfer moves one contiguous buffer from one sending process to one
receiving process (a "pair"). A request's KV usually takes several transfers
(one per pair of prefill rank and decode rank that share KV heads), each with
its own id, the request's transfer id and the piece's index
(cluster/transport/kv_handoff.py: "<transfer id>/<k>"). Contracts:

- `expect` is called before the matching `send` starts (the decode side
  reserves and posts its receive, then the prefill side is told to send); data
  for a transfer id nobody expects fails that transfer on both sides.
- Neither call blocks on the network: pairs are connected lazily in the
  background, and `poll` reports progress. The engine loop polls.
- Every wait inside has a timeout (`timeout_s`): a peer that dies or stops
  answering turns its transfers FAILED, never into a hang.
- The caller owns the buffers and must not touch them until `poll` says DONE
  or FAILED; `forget` drops the record afterwards (or gives up on a transfer
  still in flight: its buffer is then never written or read again).
- Pairs are independent: adding or removing a peer never disturbs transfers
  between other pairs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

import torch


class TransferState(str, Enum):
    PENDING = "pending"            # queued; the pair may still be connecting
    TRANSFERRING = "transferring"  # posted on the wire
    DONE = "done"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a receiving process accepts pairs: a unique name and the
    rendezvous store (host, port) that senders connect to."""
    name: str
    host: str
    port: int


class KVSender(ABC):
    """Sending side, one per process. `name` is unique among all senders that
    will ever talk to the same receiver."""
    name: str

    @abstractmethod
    def send(self, transfer_id: str, peer: PeerAddress, buffer: torch.Tensor) -> None:
        """Queues `buffer` (contiguous) for `peer`'s matching `expect`; returns at once.
        The transport may read `buffer` until the send is over, after forget() too:
        hand it a copy nothing writes (the prefill side packs one per send)."""

    @abstractmethod
    def poll(self, transfer_id: str) -> TransferState:
        """State of this process's part of the transfer. KeyError if unknown."""

    @abstractmethod
    def error(self, transfer_id: str) -> str | None:
        """Why the transfer FAILED (None otherwise)."""

    @abstractmethod
    def forget(self, transfer_id: str) -> None:
        """Drops the transfer's record (and gives up on it if not final)."""

    @abstractmethod
    def close(self) -> None:
        """Tears down every pair; pending transfers turn FAILED."""


class KVReceiver(ABC):
    """Receiving side, one per process; senders find it at `address`."""
    address: PeerAddress

    @abstractmethod
    def expect(self, transfer_id: str, sender_name: str, buffer: torch.Tensor) -> None:
        """Receives `sender_name`'s send of `transfer_id` into `buffer` (same
        number of bytes); returns at once."""

    @abstractmethod
    def poll(self, transfer_id: str, sender_name: str) -> TransferState:
        """State of one expected transfer. KeyError if unknown."""

    @abstractmethod
    def error(self, transfer_id: str, sender_name: str) -> str | None:
        """Why the transfer FAILED (None otherwise)."""

    @abstractmethod
    def forget(self, transfer_id: str, sender_name: str) -> None:
        """Drops the record (and gives up on it if not final)."""

    @abstractmethod
    def close(self) -> None:
        """Stops accepting, tears down every pair; pending transfers turn FAILED."""

    def problem(self) -> str | None:
        """Why this receiver can take no new sender any more (None while it can)."""
        return None


class KVTransportError(RuntimeError):
    """A transfer that cannot be started (bad buffer, closed transport)."""
