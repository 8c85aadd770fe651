"""`SyncManager`: PROTOCOL.md's update lifecycle over every rollout replica."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from weightsync.control import RolloutClient
from weightsync.control.protocol import (
    PARALLELISM_CONFIG,
    ReplicaProtocol,
    derive_parallelism,
    num_ranks,
    refusal,
    served_dtype,
)
from weightsync.errors import LayoutMismatchError, RemoteReplicaError, WeightSyncError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.manager.config import ControlConfig
from weightsync.manager.report import PhaseTimes, PushSummary, SyncReport
from weightsync.plan import TargetRank

logger = logging.getLogger(__name__)

PushFn = Callable[[Sequence[TargetRank], int], Awaitable[PushSummary]]
"""Writes the new weights into `targets`; the int is the metadata epoch (it changes whenever
the targets do, so a caller may cache its plan per epoch)."""


class SyncManager:
    """Drives one weight update at a time through every rollout replica.

    The update order is PROTOCOL.md's (the Miles lifecycle):

    1. ``pause_generation`` and ``release_memory_occupation(["kv_cache"])`` on every replica;
    2. ``begin_weight_update`` on every replica (a replica that fails here stops the update:
       the sessions that began are ended and every replica resumes serving its old weights);
    3. first update, or after `add_replica` / `remove_replica`: fetch every rank's transfer
       engine info and parallelism config (cached until membership changes); with
       ``check_weight_update_equal``, snapshot and corrupt the weights of every replica;
    4. ``push(targets, epoch)``: the caller's trainer ranks write their share of the plan; a
       `LayoutMismatchError` from it means the plan was refused before any write, and the
       replicas resume serving their previous weights;
    5. ``update_weight_version`` and ``end_weight_update`` on every replica (and, after the
       first update with the check on, ``weights_checker compare``);
    6. ``resume_memory_occupation``, ``flush_cache``, ``continue_generation``.

    Every per-replica call is issued to all replicas at once. An opened session is always
    ended. When the push or anything after it fails, the replicas stay paused rather than
    serve half-written weights, are marked dirty until a later update succeeds, and the error
    names the replica (and, for transfer failures, the parameter).

    One `SyncManager` lives on the process that drives the control plane (a driver, or trainer
    rank 0); it is not thread-safe, and its coroutines must run on one event loop.
    """

    def __init__(self, replicas: Sequence[str] = (), config: ControlConfig | None = None) -> None:
        """Create a manager for `replicas` (base URLs of their main HTTP servers)."""
        self._config = config or ControlConfig()
        self._replicas: list[str] = []
        self._clients: dict[str, RolloutClient] = {}
        self._targets: tuple[TargetRank, ...] | None = None
        self._epoch = 0
        self._version = 0
        self._checked = False
        self._armed: set[str] = set()
        self._dirty: set[str] = set()
        self._protocols: dict[str, ReplicaProtocol] = {}
        # Replicas whose KV cache this update released (and so must resume).
        self._released: set[str] = set()
        for url in replicas:
            self._add(url)

    @property
    def config(self) -> ControlConfig:
        """The manager's configuration."""
        return self._config

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas the next update goes to, by base URL."""
        return tuple(self._replicas)

    @property
    def dirty_replicas(self) -> frozenset[str]:
        """Replicas whose last update failed part-way; they hold mixed weights until a later
        update to them succeeds."""
        return frozenset(self._dirty)

    @property
    def protocols(self) -> dict[str, ReplicaProtocol]:
        """What each replica serves, as learned at the last metadata fetch (by URL)."""
        return dict(self._protocols)

    @property
    def metadata_epoch(self) -> int:
        """Counts metadata refreshes; changes whenever the targets of a push change."""
        return self._epoch

    async def add_replica(self, url: str) -> None:
        """Add a replica (scale up); the next update fetches metadata again.

        Raises:
            ValueError: the replica is already managed.
        """
        self._add(url)

    def _add(self, url: str) -> None:
        url = url.rstrip("/")
        if url in self._clients:
            raise ValueError(f"replica {url} is already managed")
        self._replicas.append(url)
        self._clients[url] = RolloutClient(
            url, api_key=self._config.api_key, timeout_s=self._config.http_timeout_s
        )
        self._targets = None

    async def remove_replica(self, url: str) -> None:
        """Stop managing a replica (scale down); it is no longer contacted.

        Raises:
            ValueError: the replica is not managed.
        """
        url = url.rstrip("/")
        client = self._clients.pop(url, None)
        if client is None:
            raise ValueError(f"replica {url} is not managed; managed: {self._replicas}")
        self._replicas.remove(url)
        self._dirty.discard(url)
        self._armed.discard(url)
        self._protocols.pop(url, None)
        self._targets = None
        await client.aclose()

    async def aclose(self) -> None:
        """Close every replica's HTTP client."""
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

    async def __aenter__(self) -> SyncManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def targets(self) -> tuple[TargetRank, ...]:
        """Every rollout rank of every replica, fetched once and cached until membership
        changes."""
        if self._targets is None:
            self._targets = await self._fetch_targets()
            self._epoch += 1
        return self._targets

    async def update_weights(self, push: PushFn, *, version: str | None = None) -> SyncReport:
        """Run one update through every replica; see the class docstring for the order.

        Args:
            push: writes the weights into the targets it is given and returns what it wrote.
            version: the new weight version; default: one more than the last.

        Returns:
            What the update did, with seconds per phase.

        Raises:
            ValueError: no replica is managed.
            RemoteReplicaError: a replica refused a control call (named in the error).
            WeightSyncError: the push or the bit-exact check failed.
        """
        if not self._replicas:
            raise ValueError("no rollout replica to update: add one with add_replica(url)")
        replicas = tuple(self._replicas)
        new_version = version if version is not None else str(self._version + 1)
        cfg = self._config
        t0 = time.perf_counter()

        await self._on_all(replicas, "pause_generation", mode=cfg.pause_mode)
        self._released = set()
        if cfg.release_kv_cache:
            results = await self._call_all(replicas, "release_memory_occupation", tags=["kv_cache"])
            self._released = {u for u, r in results.items() if not isinstance(r, BaseException)}
            failures = _failures(results)
            if failures:
                # SGLang cannot resume what it did not release (it exits): only these resume.
                await self._resume(replicas, best_effort=True)
                url, exc = failures[0]
                raise RemoteReplicaError(
                    f"release_memory_occupation failed on replica {url}: {exc}; the update was "
                    "not started and every replica serves its previous weights",
                    replica=url,
                    route="release_memory_occupation",
                ) from exc
        await self._begin(replicas)
        t_paused = time.perf_counter()

        refreshed = self._targets is None
        try:
            targets = await self.targets()
            if cfg.check_weight_update_equal and not self._checked:
                # Snapshot and corrupt once; until a sync restores them, the replicas hold
                # random weights and a retry must not snapshot those.
                unarmed = [u for u in replicas if u not in self._armed]
                if unarmed:
                    await self._on_all(unarmed, "weights_checker", action="snapshot")
                    self._dirty.update(unarmed)
                    await self._on_all(unarmed, "weights_checker", action="reset_tensors")
                    self._armed.update(unarmed)
        except BaseException:
            await self._abandon(replicas, resume=not (self._dirty & set(replicas)))
            raise
        t_metadata = time.perf_counter()

        try:
            summary = await push(targets, self._epoch)
        except LayoutMismatchError:
            # Raised while the plan is built, before any byte is written: replicas whose
            # weights are intact may serve them again.
            await self._abandon(replicas, resume=not (self._dirty & set(replicas)))
            raise
        except BaseException as exc:
            self._dirty.update(replicas)
            await self._abandon(replicas, resume=False)
            exc.add_note(_stay_paused(replicas))
            raise
        t_pushed = time.perf_counter()

        bit_exact: bool | None = None
        try:
            await self._on_all(
                replicas, "update_weight_version", new_version=new_version, abort_all_requests=False
            )
        except BaseException as exc:
            await self._abandon(replicas, resume=False)
            exc.add_note(_stay_paused(replicas))
            raise
        await self._on_all(replicas, "end_weight_update")
        armed = [u for u in replicas if u in self._armed]
        if armed and not self._checked:
            await self._compare(armed)
            bit_exact = True
            self._checked = True
            self._armed.clear()
        self._dirty.difference_update(replicas)
        self._version = int(new_version) if new_version.isdigit() else self._version + 1
        t_final = time.perf_counter()

        await self._resume(replicas)
        t_end = time.perf_counter()
        report = SyncReport(
            version=new_version,
            replicas=replicas,
            phases=PhaseTimes(
                pause=t_paused - t0,
                metadata=t_metadata - t_paused,
                push=t_pushed - t_metadata,
                finalize=t_final - t_pushed,
                resume=t_end - t_final,
            ),
            push=summary,
            metadata_refreshed=refreshed,
            bit_exact=bit_exact,
        )
        logger.info(
            "weight version %s on %d replica(s): %.3f GB in %.3f s (push %.3f s, %.2f GB/s)",
            new_version,
            len(replicas),
            summary.bytes_written / 1e9,
            report.seconds,
            report.phases.push,
            report.gbps,
        )
        return report

    async def _fetch_targets(self) -> tuple[TargetRank, ...]:
        """Every rank of every replica, as it published itself; each replica's server kind
        decides where its parallelism comes from (see `weightsync.control.protocol`).

        Raises:
            RemoteReplicaError: a replica cannot be reached, publishes something invalid, or
                runs with a setting that one-sided writes cannot serve (named, with the flag
                to change).
        """
        replicas = tuple(self._replicas)
        infos = await self._on_all(replicas, "get_server_info")
        for url in replicas:
            reason = refusal(infos[url])
            if reason is not None:
                raise RemoteReplicaError(
                    f"replica {url} cannot take point-to-point updates: {reason}",
                    replica=url,
                    route="/server_info",
                )
        per_replica = await asyncio.gather(
            *(self._replica_targets(url, infos[url]) for url in replicas)
        )
        return tuple(target for targets in per_replica for target in targets)

    async def _replica_targets(self, url: str, server_info: dict[str, Any]) -> list[TargetRank]:
        client = self._clients[url]
        protocol = ReplicaProtocol.from_server_info(server_info)
        try:
            ranks = range(num_ranks(server_info))
        except ValueError as exc:
            raise RemoteReplicaError(
                f"replica {url}: {exc}", replica=url, route="/server_info"
            ) from exc
        engine_infos = asyncio.gather(*(client.get_transfer_engine_info(r) for r in ranks))
        parallelism = self._parallelism_of(client, protocol, server_info, ranks)
        infos, configs = await asyncio.gather(engine_infos, parallelism)
        self._protocols[url] = protocol
        dtype = served_dtype(server_info)
        return [
            TargetRank(
                replica=url,
                rank=rank,
                session_id=session_id,
                parallelism=config,
                weights_info={k: tuple(v) for k, v in weights_info.items()},
                dtype=dtype,
            )
            for rank, (session_id, weights_info), config in zip(ranks, infos, configs, strict=True)
        ]

    async def _parallelism_of(
        self,
        client: RolloutClient,
        protocol: ReplicaProtocol,
        server_info: dict[str, Any],
        ranks: range,
    ) -> list[ParallelismConfig]:
        """Each rank's parallelism: from ``/parallelism_config`` where served (advertised, or
        answered for rank 0 by a server that advertises nothing, such as SGLang with the
        Miles extensions), else derived from `server_info` as SGLang derives it."""
        url = client.base_url
        if protocol.kind == "sglang" and not protocol.serves(PARALLELISM_CONFIG):
            try:
                first = await client.get_parallelism_config(ranks[0])
            except RemoteReplicaError as exc:
                if exc.status_code != 404:
                    raise
                logger.info(
                    "replica %s (%s) has no /parallelism_config: derived from /server_info",
                    url,
                    protocol.describe(),
                )
                try:
                    return [derive_parallelism(server_info, rank) for rank in ranks]
                except ValueError as derive_error:
                    raise RemoteReplicaError(
                        f"replica {url}: {derive_error}", replica=url, route="/server_info"
                    ) from derive_error
            rest = await asyncio.gather(*(client.get_parallelism_config(r) for r in ranks[1:]))
            return [first, *rest]
        return list(await asyncio.gather(*(client.get_parallelism_config(r) for r in ranks)))

    async def _call_all(
        self, replicas: Sequence[str], method: str, **kwargs: Any
    ) -> dict[str, Any]:
        """Call `method` on every replica at once; each replica's result or exception."""
        results = await asyncio.gather(
            *(getattr(self._clients[url], method)(**kwargs) for url in replicas),
            return_exceptions=True,
        )
        return dict(zip(replicas, results, strict=True))

    async def _on_all(self, replicas: Sequence[str], method: str, **kwargs: Any) -> dict[str, Any]:
        """Call `method` on every replica at once; raise the first failure, naming it."""
        results = await self._call_all(replicas, method, **kwargs)
        failures = _failures(results)
        if failures:
            url, exc = failures[0]
            others = f" (and {len(failures) - 1} more replica(s))" if len(failures) > 1 else ""
            if isinstance(exc, RemoteReplicaError):
                raise exc
            raise RemoteReplicaError(
                f"{method} failed on replica {url}{others}: {exc}", replica=url, route=method
            ) from exc
        return results

    async def _begin(self, replicas: Sequence[str]) -> None:
        results = await self._call_all(
            replicas, "begin_weight_update", selector=self._config.selector
        )
        failed = _failures(results)
        if not failed:
            return
        began = [u for u, r in results.items() if not isinstance(r, BaseException)]
        await self._call_all(began, "end_weight_update")
        await self._resume(replicas, best_effort=True)
        url, exc = failed[0]
        raise RemoteReplicaError(
            f"begin_weight_update failed on replica {url}: {exc}; the update was not started "
            "and every replica serves its previous weights",
            replica=url,
            route="begin_weight_update",
        ) from exc

    async def _abandon(self, replicas: Sequence[str], *, resume: bool) -> None:
        """End every session after a failure; resume serving only if no byte was written."""
        await self._call_all(replicas, "end_weight_update")
        if resume:
            await self._resume(replicas, best_effort=True)
        else:
            logger.error("%s", _stay_paused(replicas))

    async def _resume(self, replicas: Sequence[str], *, best_effort: bool = False) -> None:
        """Serve again: take back the KV cache where this update released it, flush, continue."""
        call = self._call_all if best_effort else self._on_all
        released = [url for url in replicas if url in self._released]
        if released:
            await call(released, "resume_memory_occupation", tags=["kv_cache"])
            self._released.difference_update(released)
        for method in ("flush_cache", "continue_generation"):
            await call(replicas, method)

    async def _compare(self, replicas: Sequence[str]) -> None:
        results = await self._call_all(
            replicas,
            "weights_checker",
            action="compare",
            allow_quant_error=self._config.allow_quant_error,
            timeout_s=self._config.check_timeout_s,
        )
        failed = _failures(results)
        if failed:
            self._dirty.update(u for u, _ in failed)
            url, exc = failed[0]
            raise WeightSyncError(
                f"bit-exact check failed on replica {url}: the first sync did not restore the "
                f"snapshotted weights: {exc}"
            ) from exc


def _stay_paused(replicas: Sequence[str]) -> str:
    return (
        f"the update failed after writing began: replicas {', '.join(replicas)} stay paused "
        "(they may hold mixed weights) until a later update to them succeeds"
    )


def _failures(results: dict[str, Any]) -> list[tuple[str, BaseException]]:
    return [(u, r) for u, r in results.items() if isinstance(r, BaseException)]
