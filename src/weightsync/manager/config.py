"""Configuration of a sync: the nested `SyncConfig` and its control-plane part, `ControlConfig`."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import get_args

from weightsync.control.loops import EventLoopKind, event_loop_factory
from weightsync.control.models import PauseMode, Selector
from weightsync.sender.config import SenderConfig
from weightsync.transport import CudaIpcConfig, MooncakeConfig, TransportConfig

POLL_MIN_CPUS = 4
"""The fewest CPUs a process may run on for `ControlConfig` to poll for replies by default."""
_AUTO_POLL_S = 0.005

PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
SELECTORS: tuple[str, ...] = get_args(Selector)


DELTA_CHECKS: tuple[str, ...] = ("changes", "full")
DELTA_WHEN: tuple[str, ...] = ("always", "faster")


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlConfig:
    """How `SyncManager` drives the rollout replicas through an update.

    Attributes:
        api_key: sent as ``Authorization: Bearer`` to every replica, or None.
        check_weight_update_equal: snapshot and corrupt every replica's weights before the
            first sync, and require the first sync to restore them bit-exactly.
        allow_quant_error: let the bit-exact check accept, in block-FP8 weights only, one
            e4m3 step of either side after dequantisation (SGLang's weights checker).
        pause_mode: how in-flight requests are paused (``abort``, ``retract``, ``in_place``).
        selector: which weights a session updates (``target``, ``draft``, ``all``).
        release_kv_cache: release the KV cache during the update and resume it after.
        manage_generation: run the whole lifecycle (True), or only weightsync's part of it
            (False): begin, metadata, push, version and end, with no ``pause_generation``,
            ``release_memory_occupation``, ``resume_memory_occupation``, ``flush_cache`` or
            ``continue_generation``, for a host that pauses generation and releases the KV
            cache before the update and resumes and flushes after it (verl's
            ``CheckpointEngineManager``). A failure after writing began still ends every
            session; the replicas then hold their weights incomplete, and the host must keep
            them paused (`SyncManager.dirty_replicas` names them).
        http_timeout_s: per-request timeout of control-plane calls that fetch metadata.
        check_timeout_s: timeout of the weights checker's calls (they touch every parameter).
        lifecycle_timeout_s: deadline of each lifecycle call (pause, release, begin, version,
            end, resume, flush, continue): a replica that misses it before any write is
            dropped from the sync (and resumed), so one sick replica cannot hold the healthy
            ones paused.
        lease_s: the lease of a weight-update session on replicas that take leases (the
            reference server): renewed every third of it while the sync runs, so a trainer
            that dies mid-sync leaves its session to expire after at most this long, and the
            replica then marks its weights incomplete by itself.
        event_loop: the event loop `TrainerSync` runs the lifecycle on
            (`weightsync.control.loops`): ``auto`` (uvloop where installed), ``asyncio`` or
            ``uvloop``.
        poll_replies_s: how long the manager polls for the reply of a fused lifecycle call
            (``begin_weight_sync``; ``end_weight_sync`` once the push's copies landed)
            before it sleeps until the reply comes: its event loop turns without sleeping
            meanwhile, and the reply is read the moment it arrives rather than when the
            kernel wakes the thread (on an idle host, tens to hundreds of microseconds
            later). 0 turns it off; None (the default): 5 ms where this process may run on
            at least `POLL_MIN_CPUS` CPUs, else off (on fewer, the polling thread takes the
            CPU the replica needs to answer).
        delta_check: how a replica that takes a delta checks its weights after applying it
            (``POST /weightsync/apply_delta``'s ``check``): ``"changes"`` derives each
            changed parameter's checksum from its proven base and the elements it wrote
            (work in the changes); ``"full"`` reads every byte again, which also sees a stray
            write since the base was proven into an element no payload changed (see
            docs/concepts.md, "Delta syncs").
        delta_when: when a replica that can prove its base takes a delta: ``"always"``, or
            ``"faster"``: only while its last delta's push phase was shorter than its last
            full write's, as measured in this driver's own syncs (over a link as fast as
            a same-GPU or NVLink copy, full bytes cost less than encoding a delta; behind
            a NIC the delta wins), trying a delta again after
            `weightsync.manager.delta.RETRY_DELTA_AFTER` full writes so chosen.

    Raises:
        ValueError: an unknown pause mode, selector, delta check, delta policy or event
            loop (or uvloop where it is not installed), or a timeout that is not positive.
    """

    api_key: str | None = None
    check_weight_update_equal: bool = False
    allow_quant_error: bool = False
    pause_mode: str = "abort"
    selector: str = "target"
    release_kv_cache: bool = True
    manage_generation: bool = True
    http_timeout_s: float = 60.0
    check_timeout_s: float = 600.0
    lifecycle_timeout_s: float = 10.0
    lease_s: float = 30.0
    event_loop: EventLoopKind = "auto"
    poll_replies_s: float | None = None
    delta_check: str = "changes"
    delta_when: str = "always"

    def __post_init__(self) -> None:
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"ControlConfig.pause_mode={self.pause_mode!r}: choose one of {PAUSE_MODES}"
            )
        if self.selector not in SELECTORS:
            raise ValueError(f"ControlConfig.selector={self.selector!r}: choose one of {SELECTORS}")
        if self.delta_check not in DELTA_CHECKS:
            raise ValueError(
                f"ControlConfig.delta_check={self.delta_check!r}: choose one of {DELTA_CHECKS}"
            )
        if self.delta_when not in DELTA_WHEN:
            raise ValueError(
                f"ControlConfig.delta_when={self.delta_when!r}: choose one of {DELTA_WHEN}"
            )
        for name in ("http_timeout_s", "check_timeout_s", "lifecycle_timeout_s", "lease_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ControlConfig.{name} must be positive, got {value!r}")
        poll = self.poll_replies_s
        if poll is not None and not (isinstance(poll, int | float) and 0 <= poll <= 1):
            raise ValueError(
                f"ControlConfig.poll_replies_s must be between 0 and 1 second, got {poll!r}"
            )
        if not isinstance(self.manage_generation, bool):
            raise ValueError(
                f"ControlConfig.manage_generation must be True or False, got "
                f"{self.manage_generation!r}"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ControlConfig.api_key must not be empty; use None for no key")
        try:
            event_loop_factory(self.event_loop)
        except ValueError as exc:
            raise ValueError(f"ControlConfig.event_loop: {exc}") from None

    @property
    def reply_poll_s(self) -> float:
        """`poll_replies_s` as it applies on this host (0: no polling)."""
        if self.poll_replies_s is not None:
            return float(self.poll_replies_s)
        return _AUTO_POLL_S if _usable_cpus() >= POLL_MIN_CPUS else 0.0


def _usable_cpus() -> int:
    """How many CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConfig:
    """Everything a `TrainerSync` needs to know, one part per component.

    Attributes:
        sender: how each rank stages and writes its share (`SenderConfig`).
        control: how the driver rank runs the update lifecycle (`ControlConfig`).
        transport: which transport every rank writes with, and how: a `MooncakeConfig`
            (RDMA / TCP) or a `CudaIpcConfig` (GPUs of one host).
        collective_timeout_s: how long a message between the trainer ranks of one sync may
            wait (the followers wait for the driver through pause, metadata and the check,
            the driver for every rank's push): past it every waiting rank raises
            `CollectiveError` rather than blocking on a dead or stopped rank.
        check_replicas: before every push, compare a digest of each box across the ranks
            that hold it (data-parallel copies, replicated norms) and refuse the sync with
            `WeightsRefusedError` if copies differ: a debugging aid for sharded trainers
            (one more all-gather, and every held tensor read once more).
        delta: write only what changed since the last sync into replicas that can prove
            they hold it (`weightsync.manager.delta`): every rank keeps a reference copy of
            the bytes it last pushed (``sender.delta_reference`` says where) and the others
            take full bytes; off by default.

    Raises:
        ValueError: a part of the wrong type.
    """

    sender: SenderConfig = field(default_factory=SenderConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    transport: TransportConfig = field(default_factory=MooncakeConfig)
    collective_timeout_s: float = 1800.0
    check_replicas: bool = False
    delta: bool = False

    def __post_init__(self) -> None:
        value = self.collective_timeout_s
        if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
            raise ValueError(f"SyncConfig.collective_timeout_s must be positive, got {value!r}")
        for name, kind in (("sender", SenderConfig), ("control", ControlConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(
                    f"SyncConfig.{name} must be a {kind.__name__}, got "
                    f"{type(getattr(self, name)).__name__}"
                )
        if not isinstance(self.transport, MooncakeConfig | CudaIpcConfig):
            raise ValueError(
                "SyncConfig.transport must be a MooncakeConfig or a CudaIpcConfig, got "
                f"{type(self.transport).__name__}"
            )
