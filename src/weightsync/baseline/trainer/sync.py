"""`BroadcastSync`: the broadcast baseline, as one collective call over the trainer's ranks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from weightsync.baseline.flat_bucket import FLATTENED_BUCKET
from weightsync.baseline.trainer.buckets import BroadcastBucket, plan_buckets
from weightsync.baseline.trainer.config import BroadcastConfig
from weightsync.baseline.trainer.group import BroadcastGroup
from weightsync.baseline.trainer.packer import BucketPacker
from weightsync.control.loops import new_event_loop
from weightsync.layout import model_dtype
from weightsync.layout.dtypes import canonical_dtype_name
from weightsync.manager import PushResult, SyncManager, SyncReport
from weightsync.manager.collective import Collective, NoPush, PushOrder, SyncDone, SyncFailed
from weightsync.plan import SourceHolding, TargetRank
from weightsync.plan.types import TensorMeta

T = TypeVar("T")


class BroadcastSync:
    """Pushes weights into every replica the way verl's and slime's NCCL engines do.

    Trainer rank 0 joins one torch.distributed group with every rank of every replica
    (SGLang's ``init_weights_update_group``; re-created when the replicas change). Per sync
    it gathers the full HF tensors (its own, and over the trainer group the pipeline stages
    it does not hold), packs them, cast to the rollout dtype, into flat buckets of
    ``bucket_bytes``, and for each bucket tells every replica to receive it
    (``update_weights_from_distributed``, all replicas at once) while it broadcasts the
    bucket; the next bucket is packed meanwhile (two buffers). Every rollout rank receives
    every bucket whole and loads it tensor by tensor into its parameters.

    The lifecycle around the push is `SyncManager.update_weights`' (pause, begin, push,
    version, end, resume), so a report times the same span as a P2P sync's.

    Call protocol, like `weightsync.manager.TrainerSync`: every rank of the trainer group
    builds ``BroadcastSync(...)`` (the `SyncManager` on group rank 0 only), calls
    ``sync(export)`` after each step with its PP-local export, and ``close()`` at the end.

    Args:
        hf_config: the model's HF config (object or config.json dict).
        config: the baseline's settings.
        group: the trainer's process group (None for a single process).
        manager: the `SyncManager` on group rank 0, None elsewhere.
        dtype: the rollout dtype name; default: the config's.

    Raises:
        ValueError: a manager on a rank other than 0, or none on rank 0.
    """

    def __init__(
        self,
        *,
        hf_config: Any,
        config: BroadcastConfig | None = None,
        group: Any = None,
        manager: SyncManager | None = None,
        dtype: str | None = None,
    ) -> None:
        self._config = config or BroadcastConfig()
        self._group = group
        self._rank = 0 if group is None else dist.get_rank(group)
        self._world_size = 1 if group is None else dist.get_world_size(group)
        if (manager is not None) != (self._rank == 0):
            raise ValueError(
                f"BroadcastSync: pass the SyncManager on trainer rank 0 only (this is rank "
                f"{self._rank}, manager {'given' if manager is not None else 'missing'})"
            )
        self._manager = manager
        self._collective = Collective(group, rank=self._rank, world_size=self._world_size)
        self._hf_config = hf_config
        self._dtype = canonical_dtype_name(dtype or model_dtype(hf_config))
        self._buckets: tuple[BroadcastBucket, ...] = ()
        self._holdings: tuple[SourceHolding, ...] | None = None
        self._broadcast_group: BroadcastGroup | None = None
        self._group_epoch = -1
        self._buffers: list[torch.Tensor] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        if manager is not None:
            # The same kind of loop as weightsync's own manager: the lifecycle compares alike.
            self._loop = new_event_loop(manager.config.event_loop)
            threading.Thread(
                target=self._loop.run_forever, name="weightsync-baseline", daemon=True
            ).start()

    @property
    def manager(self) -> SyncManager | None:
        """The manager on rank 0, None elsewhere."""
        return self._manager

    @property
    def buckets(self) -> tuple[BroadcastBucket, ...]:
        """The buckets of the last sync (every rank computes the same)."""
        return self._buckets

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the manager on rank 0's loop.

        Raises:
            ValueError: called on a rank other than 0.
        """
        if self._loop is None:
            raise ValueError("BroadcastSync.run is for trainer rank 0 only")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def sync(
        self,
        export: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        version: str | None = None,
    ) -> SyncReport:
        """Broadcast the weights into every replica; collective over the trainer group.

        Args:
            export: this rank's PP-local ``(hf_name, tensor)`` stream (a `ModelExport`) or
                mapping; it is read once per sync, as views.
            version: the new weight version; default: the manager's next.

        Raises:
            ValueError / LayoutMismatchError: the trainer's tensors do not make up the
                checkpoint (raised on every rank before any replica is paused).
            WeightSyncError: as `SyncManager.open_update` / `finish_update` raised on rank 0.
        """
        tensors = dict(export.items() if isinstance(export, Mapping) else export)
        mine = SourceHolding(
            rank=self._rank,
            tensors={
                name: TensorMeta(shape=tuple(t.shape), dtype=str(t.dtype))
                for name, t in tensors.items()
            },
        )
        holdings = tuple(self._all_gather(mine))
        if holdings != self._holdings:
            self._buckets = plan_buckets(
                holdings,
                hf_config=self._hf_config,
                dtype=self._dtype,
                bucket_bytes=self._config.bucket_bytes,
            )
            self._holdings = holdings
        packer = BucketPacker(tensors, rank=self._rank, group=self._group)
        if self._manager is None:
            return self._follow(packer)
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        manager, ordered = self._manager, False
        try:
            # Never fenced: the broadcast writes into the replicas' parameters on their own
            # streams.
            update = self.run(manager.open_update(version=version))
            ordered = True
            self._collective.broadcast(PushOrder(new_plan=False), (PushOrder,))
            try:
                outcome: PushResult | BaseException = self.run(
                    self._push(update.targets, update.epoch, packer, device)
                )
            except Exception as exc:
                outcome = exc
            report = self.run(manager.finish_update(update, outcome))
        except BaseException as exc:
            if not ordered:
                self._collective.broadcast(NoPush(), (NoPush,))
            self._collective.broadcast(SyncFailed(error=exc), (SyncFailed,))
            raise
        self._collective.broadcast(SyncDone(report=report), (SyncDone,))
        return report

    def close(self) -> None:
        """Rank 0: leave the weights update group on every replica and here, stop the loop."""
        if self._loop is None:
            return
        if self._broadcast_group is not None:
            self.run(self._broadcast_group.close())
        if self._manager is not None:
            self.run(self._manager.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None
        self._buffers = []

    def _follow(self, packer: BucketPacker) -> SyncReport:
        if isinstance(self._collective.broadcast(None, (PushOrder, NoPush)), PushOrder):
            packer.send_share(self._buckets)
        outcome = self._collective.broadcast(None, (SyncDone, SyncFailed))
        if isinstance(outcome, SyncFailed):
            raise outcome.error
        return outcome.report

    async def _push(
        self,
        targets: Sequence[TargetRank],
        epoch: int,
        packer: BucketPacker,
        device: torch.device,
    ) -> PushResult:
        """Rank 0: open the group if the replicas changed, then pack and broadcast every
        bucket, the next one packed while the current one travels and loads."""
        t0 = time.perf_counter()
        buckets = self._buckets
        next_fill = 0
        try:
            group = await self._open_group(targets, epoch, device)
            buffers = self._buffers_for(buckets, device)
            await asyncio.to_thread(packer.fill, buckets[0], buffers[0])
            next_fill = 1
            for k, bucket in enumerate(buckets):
                buffer = buffers[k % 2][: bucket.num_bytes]
                # The replicas are told to receive while this rank broadcasts, not after: an
                # NCCL group's first collective blocks the caller until every member joined.
                update = self._broadcast_group.update(  # type: ignore[union-attr]
                    names=bucket.names, dtypes=bucket.dtypes, shapes=bucket.shapes
                )
                steps = [update, asyncio.to_thread(self._send, group, bucket, buffer)]
                if k + 1 < len(buckets):
                    steps.append(asyncio.to_thread(packer.fill, buckets[k + 1], buffers[1 - k % 2]))
                results = await asyncio.gather(*steps, return_exceptions=True)
                next_fill = min(k + 2, len(buckets))
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
        except BaseException:
            # The group is in an unknown state: drop it (the next sync makes a new one), and
            # take what other trainer ranks still send so they reach the end of the sync.
            await asyncio.to_thread(packer.drain, buckets[next_fill:], device)
            if self._broadcast_group is not None:
                await self._broadcast_group.close()
            raise
        return _summary(targets, buckets, time.perf_counter() - t0, self._config.load_format)

    async def _open_group(
        self, targets: Sequence[TargetRank], epoch: int, device: torch.device
    ) -> dist.ProcessGroup:
        if self._broadcast_group is None:
            self._broadcast_group = BroadcastGroup(
                self._config,
                api_key=self._manager.config.api_key,  # type: ignore[union-attr]
                device=device,
            )
        if not self._broadcast_group.is_open or self._group_epoch != epoch:
            ranks: dict[str, int] = {}
            for target in targets:
                ranks[target.replica] = ranks.get(target.replica, 0) + 1
            await self._broadcast_group.open(list(ranks.items()))
            self._group_epoch = epoch
        return self._broadcast_group.group

    def _send(
        self, group: dist.ProcessGroup, bucket: BroadcastBucket, buffer: torch.Tensor
    ) -> None:
        """Broadcast one bucket (whole, or tensor by tensor) and wait for it: on the host
        for gloo; for NCCL the current stream waits, so the buffer is refilled only after."""
        if self._config.load_format == FLATTENED_BUCKET:
            works = [dist.broadcast(buffer, group=group, group_src=0, async_op=True)]
        else:
            works = [
                dist.broadcast(view, group=group, group_src=0, async_op=True)
                for _, view in bucket.layout.views(buffer)
            ]
        for work in works:
            work.wait()

    def _buffers_for(
        self, buckets: Sequence[BroadcastBucket], device: torch.device
    ) -> list[torch.Tensor]:
        """Two buffers of the largest bucket, kept from one sync to the next."""
        num_bytes = max(b.num_bytes for b in buckets)
        if (
            len(self._buffers) != 2
            or self._buffers[0].numel() < num_bytes
            or self._buffers[0].device != device
        ):
            self._buffers = []
            self._buffers = [
                torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2)
            ]
        return self._buffers

    def _all_gather(self, holding: SourceHolding) -> list[SourceHolding]:
        if self._world_size == 1:
            return [holding]
        gathered: list[Any] = [None] * self._world_size
        dist.all_gather_object(gathered, holding, group=self._group)
        return sorted(gathered, key=lambda h: h.rank)


def _summary(
    targets: Sequence[TargetRank],
    buckets: Sequence[BroadcastBucket],
    seconds: float,
    load_format: str | None,
) -> PushResult:
    per_replica: dict[str, int] = {}
    for target in targets:
        loaded = sum(numel * size for _, numel, size in target.weights_info.values())
        per_replica[target.replica] = per_replica.get(target.replica, 0) + loaded
    num_tensors = sum(len(b.layout.spans) for b in buckets)
    return PushResult(
        bytes_written=sum(per_replica.values()),
        bytes_staged=sum(b.num_bytes for b in buckets),
        num_writes=len(buckets) if load_format == FLATTENED_BUCKET else num_tensors,
        num_regions=num_tensors,
        bytes_per_replica=per_replica,
        seconds_per_source={0: seconds},
    )
