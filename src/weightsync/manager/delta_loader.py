"""The driver's side of delta calls into SGLang as released (`weightsync.delta_wire`).

A replica started with ``--custom-weight-loader weightsync.integrations.sglang.apply_delta``
takes a delta call through ``POST /update_weights_from_tensor``: one small descriptor per
rank names where the trainers keep the rank's payloads, the checksums it must hold before
and after, and a *reply slot*, memory of the driver's own registered with its transport, that
the rank writes its verdict into. SGLang's answer says nothing of what the loader did; the
slot says everything.

`LoaderCalls` owns those slots: per replica, one host buffer registered with the driver's
Mooncake transport, grown to the largest call and zeroed before each, and a call id that
never repeats, so that a slot still holding an earlier call's reply is never read as this
call's.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weightsync.control import RolloutClient
from weightsync.delta_wire import (
    LOAD_FORMAT,
    DeltaDescriptor,
    DeltaReply,
    Remote,
    ReplyError,
    reply_bytes,
    request_body,
)
from weightsync.errors import RemoteReplicaError
from weightsync.plan import TargetRank
from weightsync.transport import MooncakeTransport

_ROUTE = "/update_weights_from_tensor"
# Room after the loader's own deadline for SGLang to answer the call.
_REPLY_MARGIN_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCall:
    """One rank's share of a delta call.

    Attributes:
        payloads: where each payload lies in the trainers' memory, in the order to apply
            them (none: the call only reads the rank's checksums).
        base: ``{param_name: checksum}`` the rank must hold before anything is written.
        expected: ``{param_name: checksum}`` after applying, for the parameters the
            payloads change.
    """

    payloads: tuple[Remote, ...] = ()
    base: Mapping[str, int] = field(default_factory=dict)
    expected: Mapping[str, int] = field(default_factory=dict)


class LoaderCalls:
    """Delta calls into replicas that run the delta loader (see the module).

    Args:
        transport: the driver's transport; the replicas' ranks write their replies into
            memory registered with it, and read the trainers' payloads with the same
            protocol.
        timeout_s: how long a rank waits for each read and for its reply's write.
    """

    def __init__(self, transport: MooncakeTransport, *, timeout_s: float) -> None:
        self._transport = transport
        self._timeout_s = timeout_s
        self._slots: dict[str, torch.Tensor] = {}
        # Random start: replies left in a slot by another driver process never match.
        self._next_call = secrets.randbits(48) + 1

    async def call(
        self,
        client: RolloutClient,
        targets: Sequence[TargetRank],
        ranks: Mapping[int, RankCall],
        *,
        finish: bool,
    ) -> dict[int, DeltaReply]:
        """Send one delta call to the replica behind `client` and read every rank's reply.

        Args:
            client: the replica's client.
            targets: every rank of the replica, as it published itself.
            ranks: each rank's share; a rank not named only reads its checksums.
            finish: the session's last call into the replica: its ranks run the model's
                post-load processing once their call verified (SGLang skips it at the
                session's end once a loader ran in the session).

        Returns:
            ``{tp_rank: reply}``, whatever each reply's status.

        Raises:
            RemoteReplicaError: the call failed, or a rank wrote no reply to it.
        """
        url = client.base_url
        ordered = sorted(targets, key=lambda t: t.rank)
        if [t.rank for t in ordered] != list(range(len(ordered))):
            raise RemoteReplicaError(
                f"replica {url}: a delta call needs every rank 0..n-1, got "
                f"{[t.rank for t in ordered]}",
                replica=url,
                route=_ROUTE,
            )
        sizes = [reply_bytes(len(t.weights_info)) for t in ordered]
        memory = await self._memory(url, sum(sizes))
        call_id = self._next_call
        self._next_call += 1
        descriptors, slots, offset = [], [], 0
        for target, size in zip(ordered, sizes, strict=True):
            share = ranks.get(target.rank, RankCall())
            slot = memory[offset : offset + size]
            slots.append(slot)
            descriptors.append(
                DeltaDescriptor(
                    call_id=call_id,
                    rank=target.rank,
                    protocol=self._transport.config.protocol,
                    payloads=share.payloads,
                    base=share.base,
                    expected=share.expected,
                    reply=Remote(
                        session_id=self._transport.session_id,
                        addr=slot.data_ptr(),
                        num_bytes=size,
                    ),
                    finish=finish,
                    timeout_s=self._timeout_s,
                )
            )
            offset += size
        body = request_body(descriptors)
        most_payloads = max(len(d.payloads) for d in descriptors)
        await client.update_weights_from_tensor(
            serialized_named_tensors=body["serialized_named_tensors"],
            load_format=LOAD_FORMAT,
            flush_cache=False,
            selector="target",
            # Each rank waits up to timeout_s for each read and for its reply's write.
            timeout_s=self._timeout_s * (1 + most_payloads) + _REPLY_MARGIN_S,
        )
        replies = {}
        for target, slot in zip(ordered, slots, strict=True):
            try:
                replies[target.rank] = DeltaReply.decode(
                    slot.numpy().tobytes(), call_id=call_id, names=target.weights_info
                )
            except ReplyError as exc:
                raise RemoteReplicaError(
                    f"replica {url} rank {target.rank}: {exc}", replica=url, route=_ROUTE
                ) from exc
        return replies

    async def _memory(self, url: str, num_bytes: int) -> torch.Tensor:
        """Zeroed registered memory of at least `num_bytes` for replica `url`'s slots."""
        memory = self._slots.get(url)
        if memory is None or memory.numel() < num_bytes:
            self.forget(url)
            memory = torch.zeros(max(num_bytes, 4096), dtype=torch.uint8)
            # Registration may pin pages with the NIC: off the event loop.
            await asyncio.to_thread(self._transport.register, memory.data_ptr(), memory.numel())
            self._slots[url] = memory
        memory.zero_()
        return memory

    def forget(self, url: str) -> None:
        """Unregister and free replica `url`'s slots (it left, or the driver closes)."""
        memory = self._slots.pop(url, None)
        if memory is not None:
            self._transport.unregister(memory.data_ptr())

    def close(self) -> None:
        """Unregister and free every replica's slots."""
        for url in list(self._slots):
            self.forget(url)
