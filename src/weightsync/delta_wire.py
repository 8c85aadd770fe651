"""What crosses SGLang's ``/update_weights_from_tensor`` for a delta sync, and what comes back.

SGLang 0.5.23 hands each tensor-parallel rank its own entry of ``serialized_named_tensors``
(a pickle of ``[(name, tensor)]``, unpickled with an allow-list) and calls the function named
by ``load_format`` with the model and those named tensors. Its reply says only
``{"success": true, "message": "Success"}`` whatever the function did, and an exception from
the function kills the server. So the call carries a small *descriptor* per rank, and the rank
answers through memory the trainer registered:

1. The manager writes nothing into the rank. Each trainer rank keeps its encoded payload for
   the rank (`weightsync.delta_codec`) in memory registered with its transport, and the
   manager zeroes a *reply slot* of `reply_bytes` in registered memory of its own.
2. The manager sends `request_body` of one `DeltaDescriptor` per rank: where each payload
   lies (the trainer's session id, address and size), the checksums the rank must hold
   before (its base) and after, and the reply slot.
3. The rank reads the payloads one-sidedly, checks its base, applies them, checks the
   result, and writes a `DeltaReply` into the reply slot, one-sidedly. SGLang then answers
   the HTTP call; the manager reads each rank's reply (`DeltaReply.decode`).

The descriptor is a uint8 tensor of UTF-8 JSON under the name `DESCRIPTOR_NAME`. It is
pickled with the standard pickler (`request_body`), which puts the tensor's bytes in the
pickle: torch's multiprocessing pickler would send a shared-memory handle instead, which
means nothing on another host.

This module imports torch and the standard library only: the manager builds calls with it
(`weightsync.manager.delta_loader`), the rank's worker reads them
(`weightsync.integrations.sglang.apply_delta`).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
import math
import pickle
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

LOAD_FORMAT = "weightsync.integrations.sglang.apply_delta"
"""The ``--custom-weight-loader`` to start SGLang with and the ``load_format`` to call."""
DESCRIPTOR_NAME = "weightsync.delta"
DESCRIPTOR_VERSION = 1
PROTOCOLS = ("tcp", "rdma")

REPLY_MAGIC = 0x57534445_4C545231  # "WSDELTR1"
REPLY_HEADER_WORDS = 8
REPLY_HEADER_BYTES = REPLY_HEADER_WORDS * 8
DEFAULT_MESSAGE_BYTES = 1024

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class DescriptorError(ValueError):
    """A descriptor that is not one `request_body` writes: the rank can do nothing with it
    (not even reply)."""


class ReplyError(ValueError):
    """A reply slot that holds no reply to the call (none was written, or another call's)."""


class ReplyStatus(enum.IntEnum):
    """What a call did on one rank.

    ``APPLIED``: every payload applied and every checksum matched (a call without payloads
    read the checksums). ``REFUSED``: nothing was written: the base differed, or the
    descriptor or a payload did not fit, or a payload could not be read. ``FAILED``: bytes
    were written but the result is not what the trainers meant (a checksum after applying
    differs, a later payload was refused, or post-load processing failed): the rank's
    weights are incomplete.
    """

    APPLIED = 1
    REFUSED = 2
    FAILED = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Remote:
    """Bytes in memory a peer registered with its transport.

    Attributes:
        session_id: the peer transport's session id (``"host:port"``).
        addr: the first byte's address in the peer's process.
        num_bytes: how many bytes (positive).
    """

    session_id: str
    addr: int
    num_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise DescriptorError(f"a session id must be a non-empty string: {self!r}")
        for name in ("addr", "num_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _INT64_MAX:
                raise DescriptorError(f"{name} must be a positive 64-bit int: {self!r}")

    def to_dict(self) -> dict[str, object]:
        """A JSON-able form."""
        return {"session_id": self.session_id, "addr": self.addr, "num_bytes": self.num_bytes}


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaDescriptor:
    """One rank's share of a delta call.

    Attributes:
        call_id: a number the manager picks per call (1 .. 2**63 - 1); the reply repeats it,
            so that a slot still holding an earlier call's reply is never taken for this one.
        rank: the tensor-parallel rank it is for (the rank checks it is that rank).
        protocol: the trainers' Mooncake protocol, ``"tcp"`` or ``"rdma"``; the rank reads
            with the same.
        payloads: where each payload lies, in the order to apply them (none: the call only
            reads the rank's checksums).
        base: ``{param_name: checksum}`` the rank must hold before anything is written; it
            names at least every parameter of `expected`.
        expected: ``{param_name: checksum}`` after applying, for the parameters the payloads
            change (names as SGLang publishes them in ``weights_info``).
        reply: the slot the rank writes its `DeltaReply` into (at least `reply_bytes` of its
            parameters, or the reply carries no checksums).
        finish: the session's last call: after a verified call, run the post-load processing
            (``model.post_load_weights``) that ``end_weight_update`` skips once a loader ran
            in the session.
        timeout_s: how long the rank waits for each read and for its reply's write.
    """

    call_id: int
    rank: int
    protocol: str
    payloads: tuple[Remote, ...]
    base: Mapping[str, int] = field(default_factory=dict)
    expected: Mapping[str, int] = field(default_factory=dict)
    reply: Remote
    finish: bool = False
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not _is_int(self.call_id) or not 0 < self.call_id <= _INT64_MAX:
            raise DescriptorError(f"call_id must be in 1 .. 2**63-1, got {self.call_id!r}")
        if not _is_int(self.rank) or self.rank < 0:
            raise DescriptorError(f"rank must be a non-negative int, got {self.rank!r}")
        if self.protocol not in PROTOCOLS:
            raise DescriptorError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        object.__setattr__(self, "payloads", tuple(self.payloads))
        if not all(isinstance(p, Remote) for p in self.payloads):
            raise DescriptorError("payloads must be Remote values")
        if not isinstance(self.reply, Remote) or self.reply.num_bytes < REPLY_HEADER_BYTES:
            raise DescriptorError(
                f"the reply slot must be a Remote of at least {REPLY_HEADER_BYTES} bytes, "
                f"got {self.reply!r}"
            )
        for what in ("base", "expected"):
            checks = getattr(self, what)
            if not isinstance(checks, Mapping) or not all(
                isinstance(k, str) and _is_int(v) and _INT64_MIN <= v <= _INT64_MAX
                for k, v in checks.items()
            ):
                raise DescriptorError(f"{what} must map parameter names to int64 checksums")
            object.__setattr__(self, what, dict(checks))
        missing = sorted(set(self.expected) - set(self.base))
        if missing:
            raise DescriptorError(
                f"base must name every parameter of expected; it lacks {len(missing)} "
                f"({', '.join(missing[:3])})"
            )
        if not isinstance(self.finish, bool):
            raise DescriptorError(f"finish must be a bool, got {self.finish!r}")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not (self.timeout_s > 0 and math.isfinite(self.timeout_s))
        ):
            raise DescriptorError(f"timeout_s must be a positive number, got {self.timeout_s!r}")

    def to_tensor(self) -> torch.Tensor:
        """The descriptor as SGLang's call carries it: UTF-8 JSON in a uint8 tensor."""
        document = {
            "version": DESCRIPTOR_VERSION,
            "call_id": self.call_id,
            "rank": self.rank,
            "protocol": self.protocol,
            "payloads": [p.to_dict() for p in self.payloads],
            "base": self.base,
            "expected": self.expected,
            "reply": self.reply.to_dict(),
            "finish": self.finish,
            "timeout_s": self.timeout_s,
        }
        raw = json.dumps(document, separators=(",", ":")).encode()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @classmethod
    def from_named_tensors(
        cls, named_tensors: Sequence[tuple[str, torch.Tensor]]
    ) -> DeltaDescriptor:
        """The descriptor of a rank's ``named_tensors``, as SGLang hands them to the loader.

        Raises:
            DescriptorError: not exactly one tensor named `DESCRIPTOR_NAME` holding a
                descriptor of this version.
        """
        if len(named_tensors) != 1 or named_tensors[0][0] != DESCRIPTOR_NAME:
            names = [str(entry[0])[:60] for entry in list(named_tensors)[:3]]
            raise DescriptorError(
                f"expected one tensor named {DESCRIPTOR_NAME!r}, got {len(named_tensors)} "
                f"({names}); send weightsync.integrations.sglang.request_body"
            )
        tensor = named_tensors[0][1]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise DescriptorError("the descriptor must be a 1-D uint8 tensor")
        try:
            document = json.loads(bytes(tensor.cpu().numpy()).decode())
            version = document.get("version")
        except (ValueError, AttributeError) as exc:
            raise DescriptorError(f"the descriptor is not JSON: {exc}") from None
        if version != DESCRIPTOR_VERSION:
            raise DescriptorError(
                f"descriptor version {version!r}; this rank reads version {DESCRIPTOR_VERSION}: "
                "install the same weightsync beside SGLang as the trainers run"
            )
        try:
            return cls(
                call_id=document["call_id"],
                rank=document["rank"],
                protocol=document["protocol"],
                payloads=tuple(Remote(**p) for p in document["payloads"]),
                base=document["base"],
                expected=document["expected"],
                reply=Remote(**document["reply"]),
                finish=document["finish"],
                timeout_s=document["timeout_s"],
            )
        except (KeyError, TypeError) as exc:
            raise DescriptorError(f"the descriptor lacks or misnames a field: {exc}") from None


def serves_delta_loader(server_info: Mapping[str, object]) -> bool:
    """Whether a replica's ``/server_info`` says it was started with the delta loader
    (``--custom-weight-loader`` naming `LOAD_FORMAT`; SGLang reports it as a list)."""
    loaders = server_info.get("custom_weight_loader")
    if isinstance(loaders, str):
        loaders = [loaders]
    return isinstance(loaders, list | tuple) and LOAD_FORMAT in loaders


def request_body(
    descriptors: Sequence[DeltaDescriptor], *, load_format: str = LOAD_FORMAT
) -> dict[str, object]:
    """The JSON body of SGLang's ``POST /update_weights_from_tensor`` for one delta call.

    Args:
        descriptors: one per tensor-parallel rank of the replica, in rank order (SGLang hands
            rank r the r-th entry, and a missing entry kills its scheduler).
        load_format: the custom weight loader the replica was started with.

    Raises:
        ValueError: no descriptors, or descriptor r is not for rank r.
    """
    if not descriptors:
        raise ValueError("a delta call needs one descriptor per rank of the replica")
    for index, descriptor in enumerate(descriptors):
        if descriptor.rank != index:
            raise ValueError(
                f"descriptor {index} is for rank {descriptor.rank}: give them in rank order"
            )
    serialized = [
        # The standard pickler (protocol 4: SGLang recognises raw pickles by their first
        # byte) puts the tensor's bytes in the stream; SGLang's unpickler allows
        # torch.storage._load_from_bytes and torch._utils._rebuild_tensor_v2.
        base64.b64encode(pickle.dumps([(DESCRIPTOR_NAME, d.to_tensor())], protocol=4)).decode()
        for d in descriptors
    ]
    return {
        "serialized_named_tensors": serialized,
        "load_format": load_format,
        # SGLang's defaults flush the cache after the call and apply it to draft models too;
        # the manager flushes once the session ends, and only the target holds these names.
        "flush_cache": False,
        "abort_all_requests": False,
        "selector": "target",
    }


def reply_bytes(num_params: int, *, message_bytes: int = DEFAULT_MESSAGE_BYTES) -> int:
    """The size of a reply slot that holds the checksums of `num_params` parameters and a
    message of up to `message_bytes` bytes."""
    return REPLY_HEADER_BYTES + 8 * num_params + _align8(message_bytes)


def names_digest(names: Iterable[str]) -> int:
    """A 64-bit digest of sorted parameter names: a reply's checksums are in that order, and
    the digest shows both ends sorted the same names."""
    joined = "\n".join(sorted(names)).encode()
    return struct.unpack("<q", hashlib.blake2b(joined, digest_size=8).digest())[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaReply:
    """What a rank wrote into its reply slot.

    Attributes:
        call_id: the call it answers.
        status: what the call did.
        num_elements: elements the payloads wrote.
        checksums: ``{param_name: checksum}`` of every parameter when the call ended (before
            post-load processing): the next base when the status is ``APPLIED``; empty when
            the slot was too small for them.
        message: what happened, in words (why, for a refused or failed call).
        seconds: what the call took on the rank.
    """

    call_id: int
    status: ReplyStatus
    num_elements: int
    checksums: Mapping[str, int]
    message: str
    seconds: float

    @property
    def verified(self) -> bool:
        """The rank holds exactly what the trainers meant."""
        return self.status is ReplyStatus.APPLIED

    def encode(self, capacity: int) -> bytes:
        """The reply as it is written into a slot of `capacity` bytes: the checksums, in the
        order of sorted names, only when they fit beside the header; the message cut to
        what is left."""
        names = sorted(self.checksums)
        values = [self.checksums[n] for n in names]
        if REPLY_HEADER_BYTES + 8 * len(values) > capacity:
            values, digest = [], names_digest(())
        else:
            digest = names_digest(names)
        room = capacity - REPLY_HEADER_BYTES - 8 * len(values)
        message = self.message.encode()[:room]
        head = [
            REPLY_MAGIC,
            self.call_id,
            int(self.status),
            self.num_elements,
            len(values),
            digest,
            len(message),
            round(self.seconds * 1e6),
        ]
        return struct.pack(f"<{len(head)}q{len(values)}q", *head, *values) + message

    @classmethod
    def decode(cls, raw: bytes, *, call_id: int, names: Iterable[str]) -> DeltaReply:
        """Read the reply to call `call_id` from a slot's bytes.

        Args:
            raw: the slot's bytes.
            call_id: the call the reply must answer.
            names: the rank's parameter names as SGLang publishes them (``weights_info``);
                the checksums come back by name.

        Raises:
            ReplyError: the slot holds no reply to `call_id`, or one whose checksums are
                over other names.
        """
        if len(raw) < REPLY_HEADER_BYTES:
            raise ReplyError(f"a reply slot holds at least {REPLY_HEADER_BYTES} bytes")
        head = struct.unpack_from(f"<{REPLY_HEADER_WORDS}q", raw)
        magic, answered, status, num_elements, num_params, digest, message_len, micros = head
        if magic != REPLY_MAGIC or answered != call_id:
            raise ReplyError(
                f"no reply to call {call_id} (the rank wrote none; see the replica's log)"
            )
        try:
            status = ReplyStatus(status)
        except ValueError:
            raise ReplyError(f"reply to call {call_id} has unknown status {status}") from None
        end = REPLY_HEADER_BYTES + 8 * num_params
        if num_params < 0 or message_len < 0 or end + message_len > len(raw):
            raise ReplyError(f"reply to call {call_id} does not fit its slot")
        checksums: dict[str, int] = {}
        if num_params:
            ordered = sorted(names)
            if len(ordered) != num_params or names_digest(ordered) != digest:
                raise ReplyError(
                    f"reply to call {call_id} has checksums of {num_params} parameters that are "
                    f"not the {len(ordered)} named: the replica publishes other parameters"
                )
            values = struct.unpack_from(f"<{num_params}q", raw, REPLY_HEADER_BYTES)
            checksums = dict(zip(ordered, values, strict=True))
        message = bytes(raw[end : end + message_len]).decode(errors="replace")
        return cls(
            call_id=answered,
            status=status,
            num_elements=num_elements,
            checksums=checksums,
            message=message,
            seconds=micros / 1e6,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _align8(num_bytes: int) -> int:
    return (num_bytes + 7) // 8 * 8
