"""`apply_delta`: SGLang's custom weight loader that applies a weightsync delta on one rank.

SGLang 0.5.23 calls it in each tensor-parallel rank's scheduler process, on the scheduler's
thread, inside ``POST /update_weights_from_tensor`` with ``load_format`` set to its import
path (`weightsync.integrations.sglang.LOAD_FORMAT`), which the server must have been started
with (``--custom-weight-loader``). It is called as ``apply_delta(model, named_tensors)``; its
return value is ignored, and an exception it raises kills the server. So it never raises:
what it did goes into the reply slot the descriptor names (`weightsync.delta_wire`), and
what it cannot reply goes to the server's log.

Per process it keeps one Mooncake transport, made on the first call, and one host buffer
registered with it, grown to the largest call so far (payloads are read into it, the reply
is written from it). Both live as long as the process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from weightsync.delta_codec import apply_and_check, checksums
from weightsync.delta_wire import (
    DeltaDescriptor,
    DeltaReply,
    Remote,
    ReplyStatus,
)
from weightsync.transport.mooncake import MooncakeConfig, MooncakeTransport

_LOG = logging.getLogger(__name__)
_MIN_STAGING_BYTES = 1 << 20
_MAX_NAMES_SHOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class _Outcome:
    status: ReplyStatus
    message: str
    num_elements: int = 0
    checksums: Mapping[str, int] | None = None


class _Refused(Exception):
    """Nothing was written; the message says why."""


class _Worker:
    """The rank's transport and staging buffer, made on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._transport: MooncakeTransport | None = None
        self._staging: torch.Tensor | None = None

    def transport(self, descriptor: DeltaDescriptor) -> MooncakeTransport:
        """The rank's transport, speaking the trainers' protocol."""
        if self._transport is not None and self._transport.config.protocol != descriptor.protocol:
            self.close()
        if self._transport is None:
            config = MooncakeConfig(
                hostname=_hostname(descriptor.reply.session_id),
                protocol=descriptor.protocol,
                # Where SGLang's own transfer engine takes its RDMA devices from.
                device_name=os.environ.get("MOONCAKE_DEVICE", ""),
                timeout_s=descriptor.timeout_s,
                # The server's stderr is SGLang's to format; Mooncake's lines stay on it.
                capture_native_logs=False,
            )
            self._transport = MooncakeTransport(config)
        return self._transport

    def staging(self, transport: MooncakeTransport, num_bytes: int) -> torch.Tensor:
        """A registered host buffer of at least `num_bytes`."""
        if self._staging is not None and self._staging.numel() >= num_bytes:
            return self._staging
        if self._staging is not None:
            transport.unregister(self._staging.data_ptr())
            self._staging = None
        size = max(_MIN_STAGING_BYTES, 1 << (num_bytes - 1).bit_length())
        buffer = torch.empty(size, dtype=torch.uint8)
        transport.register(buffer.data_ptr(), size)
        self._staging = buffer
        return buffer

    def close(self) -> None:
        """Close the transport (the next call makes a new one)."""
        transport, self._transport, self._staging = self._transport, None, None
        if transport is not None:
            transport.close()


_WORKER = _Worker()


def apply_delta(model: torch.nn.Module, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Apply the delta a weightsync descriptor names to this rank's `model`, in place.

    SGLang calls it as its custom weight loader (see the module). In order: check that the
    checksums of the descriptor's ``base`` parameters are what the rank holds, and read the
    payloads from the trainers' memory into the rank's staging buffer (else write nothing);
    apply the payloads; check every parameter against ``expected`` and that the payloads
    wrote no parameter it does not name; when the call verified and is the session's last,
    run the model's post-load processing; write the reply, with the checksums of every
    parameter, into the reply slot. Never raises.

    Args:
        model: the rank's model; its parameters are numbered by their sorted names
            (``model.named_parameters()``, the names SGLang publishes in ``weights_info``).
        named_tensors: the rank's entry of the call: one descriptor
            (`weightsync.integrations.sglang.DeltaDescriptor`).
    """
    start = time.perf_counter()
    try:
        descriptor = DeltaDescriptor.from_named_tensors(named_tensors)
    except Exception as exc:
        _LOG.error("weightsync apply_delta: unreadable call, no reply sent: %s", exc)
        return
    where = f"rank {descriptor.rank}"
    with _WORKER.lock:
        try:
            transport = _WORKER.transport(descriptor)
            staging = _WORKER.staging(transport, _staging_bytes(descriptor))
        except Exception as exc:
            _LOG.error("weightsync apply_delta: %s: no transport, no reply sent: %s", where, exc)
            return
        try:
            outcome = _apply(model, descriptor, transport, staging, where)
        except Exception as exc:  # a bug or a device error; the weights may have changed
            _LOG.exception("weightsync apply_delta: %s failed", where)
            outcome = _Outcome(status=ReplyStatus.FAILED, message=f"{where}: {exc!r}")
        reply = DeltaReply(
            call_id=descriptor.call_id,
            status=outcome.status,
            num_elements=outcome.num_elements,
            checksums=outcome.checksums or {},
            message=outcome.message,
            seconds=time.perf_counter() - start,
        )
        log = _LOG.info if reply.verified else _LOG.error
        log("weightsync apply_delta: %s", reply.message)
        try:
            _send_reply(reply, descriptor.reply, transport, staging, descriptor.timeout_s)
        except Exception as exc:
            _LOG.error("weightsync apply_delta: %s: the reply could not be written: %s", where, exc)


def _apply(
    model: torch.nn.Module,
    descriptor: DeltaDescriptor,
    transport: MooncakeTransport,
    staging: torch.Tensor,
    where: str,
) -> _Outcome:
    # Detached views of the parameters' storage: written in place without autograd.
    params = {name: param.detach() for name, param in model.named_parameters()}
    try:
        _check_rank(descriptor, where)
        _check_names(descriptor, params, where)
        _check_base(descriptor, params, where)
        payloads = _read(descriptor, transport, staging, params, where)
    except _Refused as refused:
        return _Outcome(
            status=ReplyStatus.REFUSED,
            message=f"{refused}; nothing was written",
            checksums=checksums(params),
        )
    checked = apply_and_check(payloads, params, descriptor.expected)
    num_elements, after = checked.num_elements, checked.checksums
    problems = []
    if checked.refused == 0:
        return _Outcome(
            status=ReplyStatus.REFUSED,
            message=f"{where}: payload 0 was refused ({checked.error}); nothing was written",
            checksums=after,
        )
    if checked.refused is not None:
        problems.append(
            f"payload {checked.refused} of {len(payloads)} was refused ({checked.error}) after "
            "the ones before it were applied"
        )
    if checked.mismatched:
        problems.append(
            f"{len(checked.mismatched)} parameter(s) differ from the trainers' checksums after "
            f"applying ({_some(checked.mismatched)})"
        )
    if checked.unexpected:
        problems.append(
            f"payloads wrote {len(checked.unexpected)} parameter(s) with no expected checksum "
            f"({_some(checked.unexpected)})"
        )
    if problems:
        return _Outcome(
            status=ReplyStatus.FAILED,
            message=f"{where}: {'; '.join(problems)}; its weights are incomplete: write it full",
            num_elements=num_elements,
            checksums=after,
        )
    if payloads:
        message = (
            f"{where}: applied {num_elements} element(s) of {len(descriptor.expected)} "
            f"parameter(s) from {len(payloads)} payload(s); every checksum matched"
        )
    else:
        message = f"{where}: read the checksums of {len(after)} parameter(s)"
    if descriptor.finish:
        try:
            _post_load(model)
        except Exception as exc:
            _LOG.exception("weightsync apply_delta: %s post-load processing failed", where)
            return _Outcome(
                status=ReplyStatus.FAILED,
                message=f"{message}, but post-load processing failed: {exc!r}",
                num_elements=num_elements,
                checksums=after,
            )
    return _Outcome(
        status=ReplyStatus.APPLIED, message=message, num_elements=num_elements, checksums=after
    )


def _check_rank(descriptor: DeltaDescriptor, where: str) -> None:
    rank = _tp_rank()
    if rank is not None and rank != descriptor.rank:
        raise _Refused(
            f"tensor-parallel rank {rank} got the descriptor of {where}: the call's "
            "serialized_named_tensors must be in rank order"
        )


def _check_names(
    descriptor: DeltaDescriptor, params: Mapping[str, torch.Tensor], where: str
) -> None:
    unknown = sorted(set(descriptor.base) - set(params))
    if unknown:
        raise _Refused(
            f"{where}: the call names {len(unknown)} parameter(s) the model does not have "
            f"({_some(unknown)})"
        )
    loose = sorted(name for name in descriptor.expected if not params[name].is_contiguous())
    if loose:
        raise _Refused(f"{where}: parameter(s) not contiguous in memory ({_some(loose)})")


def _read(
    descriptor: DeltaDescriptor,
    transport: MooncakeTransport,
    staging: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    where: str,
) -> list[torch.Tensor]:
    """Each payload's bytes, read into `staging`, on the parameters' device."""
    devices = {p.device for p in params.values()}
    if descriptor.payloads and len(devices) != 1:
        raise _Refused(
            f"{where}: parameters lie on {len(devices)} devices ({sorted(map(str, devices))})"
        )
    payloads = []
    offset = 0
    for index, source in enumerate(descriptor.payloads):
        try:
            transport.read(
                source.session_id, staging.data_ptr() + offset, source.addr, source.num_bytes
            )
        except Exception as exc:
            raise _Refused(
                f"{where}: payload {index} ({source.num_bytes} bytes at {source.addr:#x} of "
                f"{source.session_id}) could not be read: {exc}"
            ) from None
        payloads.append(staging[offset : offset + source.num_bytes])
        offset += _align8(source.num_bytes)
    if payloads:
        (device,) = devices
        # On the parameters' device: apply_payload copies values with index_copy_, which
        # takes no tensors of two devices.
        payloads = [p.to(device) for p in payloads]
    return payloads


def _check_base(
    descriptor: DeltaDescriptor, params: Mapping[str, torch.Tensor], where: str
) -> None:
    now = checksums({name: params[name] for name in descriptor.base})
    differ = [name for name, value in descriptor.base.items() if now[name] != value]
    if differ:
        raise _Refused(
            f"{where}: the weights are not the base the trainers' delta is against: "
            f"{len(differ)} parameter(s) differ ({_some(differ)})"
        )


def _send_reply(
    reply: DeltaReply,
    slot: Remote,
    transport: MooncakeTransport,
    staging: torch.Tensor,
    timeout_s: float,
) -> None:
    raw = reply.encode(slot.num_bytes)
    offset = staging.numel() - slot.num_bytes
    staging[offset : offset + len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    handle = transport.write(
        slot.session_id, [staging.data_ptr() + offset], [slot.addr], [len(raw)]
    )
    transport.wait(handle, timeout_s)


def _staging_bytes(descriptor: DeltaDescriptor) -> int:
    """Payloads at 8-byte offsets, then room for the reply at the end."""
    return sum(_align8(p.num_bytes) for p in descriptor.payloads) + descriptor.reply.num_bytes


def _post_load(model: torch.nn.Module) -> None:
    # What SGLang 0.5.23's end_weight_update runs when no loader ran in the session
    # (model_loader/loader.py post_load_weights): this call made SGLang mark the session
    # loaded, so it is run here, once every byte of the session is in place.
    post_load = getattr(model, "post_load_weights", None)
    if post_load is not None:
        post_load()


def _tp_rank() -> int | None:
    """SGLang's tensor-parallel rank of this process, None outside SGLang."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        return None
    return get_parallel().tp_rank


def _hostname(peer_session: str) -> str:
    """The address this rank's transport advertises: SGLang's own choice for its transfer
    engine (``SGLANG_HOST_IP``, ``HOST_IP``), else the local address that routes to the peer."""
    chosen = os.environ.get("SGLANG_HOST_IP") or os.environ.get("HOST_IP")
    if chosen:
        return chosen
    host = peer_session.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    return shown + (", ..." if len(names) > _MAX_NAMES_SHOWN else "")


def _align8(num_bytes: int) -> int:
    return (num_bytes + 7) // 8 * 8
