"""Builds each rank's KV sender or receiver from plain settings, for the
rank's own device (gloo pairs for CPU caches, NCCL pairs for CUDA ones). The
factories are picklable (functools.partial over module functions) because they travel to
every rank of a gang through `LLMEngine.collective_rpc`."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cluster.transport.kv_transport import KVReceiver, KVSender


@dataclass(frozen=True, slots=True)
class TransportSettings:
    host: str | None = "127.0.0.1"   # the address receivers listen on; None: their node's (DecodeServer)
    timeout_s: float = 30.0      # any one wait: connecting a pair, one transfer
    secret: str = field(default="", repr=False)   # the deployment's: a receiver admits only senders that hold it


def sender_factory(settings: TransportSettings, name: str) -> Callable[[int, torch.device], KVSender]:
    return functools.partial(_make_sender, settings, name)


def receiver_factory(settings: TransportSettings, name: str) -> Callable[[int, torch.device], KVReceiver]:
    return functools.partial(_make_receiver, settings, name)


def _make_sender(settings: TransportSettings, name: str, rank: int, device: torch.device) -> KVSender:
    from cluster.transport.pair_group_sender import PairGroupSender
    return PairGroupSender(name=f"{name}-rank{rank}-{uuid.uuid4().hex[:8]}", device=device,
                           timeout_s=settings.timeout_s, secret=settings.secret)


def _make_receiver(settings: TransportSettings, name: str, rank: int, device: torch.device) -> KVReceiver:
    from cluster.transport.pair_group_receiver import PairGroupReceiver
    return PairGroupReceiver(host=settings.host, name=f"{name}-rank{rank}-{uuid.uuid4().hex[:8]}",
                             device=device, timeout_s=settings.timeout_s, secret=settings.secret)
