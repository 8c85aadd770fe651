"""`TensorSync`: the colocated baseline, SGLang's ``update_weights_from_tensor`` as verl's
``naive`` backend drives it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from weightsync.baseline.flat_bucket import FLATTENED_BUCKET
from weightsync.baseline.shared_tensors import flattened_bucket, serialize
from weightsync.baseline.trainer.packer import BucketPacker
from weightsync.baseline.trainer.sync import BroadcastSync, _summary
from weightsync.control import RolloutClient
from weightsync.manager import PushResult
from weightsync.plan import TargetRank


class TensorSync(BroadcastSync):
    """Pushes weights into replicas on the trainer's own host the way verl's ``naive``
    backend does when they share its GPUs.

    Trainer rank 0 gathers the full HF tensors (as `BroadcastSync`), packs them, cast to the
    rollout dtype, into flat buckets of ``bucket_bytes`` and, per bucket, shares the buffer
    by reference (a CUDA IPC handle; a shared-memory file on CPU) in one
    ``update_weights_from_tensor`` per replica (``load_format="flattened_bucket"``, one
    payload per tp rank), all replicas at once; every rank maps the buffer, rebuilds the
    tensors and loads each through the engine's loader. The next bucket is packed meanwhile
    (two buffers; a buffer is refilled only after every replica answered). No group is
    joined: the replicas must run on this host (and for CUDA tensors, see them).

    The lifecycle, arguments and call protocol are `BroadcastSync`'s (its config's
    ``backend``, ``master_address`` and ``group_name`` are unused).
    """

    _clients: dict[str, RolloutClient] | None = None

    async def _push(
        self,
        targets: Sequence[TargetRank],
        epoch: int,
        packer: BucketPacker,
        device: torch.device,
    ) -> PushResult:
        """Rank 0: pack and share every bucket, the next one packed while the replicas load
        the current one."""
        t0 = time.perf_counter()
        buckets = self._buckets
        ranks: dict[str, int] = {}
        for target in targets:
            ranks[target.replica] = ranks.get(target.replica, 0) + 1
        clients = self._clients_for(tuple(ranks))
        next_fill = 0
        try:
            buffers = self._buffers_for(buckets, device)
            await asyncio.to_thread(_fill, packer, buckets[0], buffers[0], device)
            next_fill = 1
            for k, bucket in enumerate(buckets):
                shared = flattened_bucket(buffers[k % 2], bucket.layout)
                # One payload per receiving rank: sharing takes a reference for one receiver
                # (it gives it back once it mapped the memory), so no payload is opened twice.
                steps = [
                    clients[url].update_weights_from_tensor(
                        serialized_named_tensors=[serialize(shared) for _ in range(num_ranks)],
                        load_format=FLATTENED_BUCKET,
                        flush_cache=False,
                        timeout_s=self._config.timeout_s,
                    )
                    for url, num_ranks in ranks.items()
                ]
                if k + 1 < len(buckets):
                    steps.append(
                        asyncio.to_thread(_fill, packer, buckets[k + 1], buffers[1 - k % 2], device)
                    )
                results = await asyncio.gather(*steps, return_exceptions=True)
                next_fill = min(k + 2, len(buckets))
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
        except BaseException:
            # Take what other trainer ranks still send, so they reach the end of the sync.
            await asyncio.to_thread(packer.drain, buckets[next_fill:], device)
            raise
        return _summary(targets, buckets, time.perf_counter() - t0, FLATTENED_BUCKET)

    def _clients_for(self, urls: Sequence[str]) -> dict[str, RolloutClient]:
        if self._clients is None:
            self._clients = {}
        api_key = self._manager.config.api_key if self._manager is not None else None
        for url in urls:
            if url not in self._clients:
                self._clients[url] = RolloutClient(
                    url, api_key=api_key, timeout_s=self._config.timeout_s
                )
        return self._clients

    def close(self) -> None:
        """Rank 0: close the HTTP clients, then as `BroadcastSync.close`."""
        if self._loop is not None and self._clients:
            clients, self._clients = self._clients, None

            async def close_all() -> None:
                await asyncio.gather(*(c.aclose() for c in clients.values()))

            self.run(close_all())
        super().close()


def _fill(packer: BucketPacker, bucket, buffer: torch.Tensor, device: torch.device) -> None:
    """Pack one bucket and wait for the copies: the replicas read the buffer as soon as
    they are told to, from another process."""
    packer.fill(bucket, buffer)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
