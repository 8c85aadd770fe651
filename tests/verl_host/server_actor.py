"""The per-node server actor of a rollout replica, in the role verl's ``SGLangHttpServer``
plays (verl/workers/rollout/sglang_rollout/async_sglang_server.py): a Ray actor that verl's
``RolloutReplica`` drives through pause, KV-cache release, resume and address lookups. Here
it fronts a running `weightsync serve` replica and forwards each call to the route SGLang's
server would get (``abort_all_requests`` is ``pause_generation(mode="abort")``,
``resume_generation`` is ``continue_generation``, ``resume_kv_cache`` resumes and flushes),
so the lifecycle verl owns reaches a real replica over HTTP.

Kept free of torch and verl imports: Ray starts one process per server actor.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from weightsync.control import RolloutClient


class ReferenceServerActor:
    """verl's view of one `weightsync serve` replica (its first and only node)."""

    def __init__(self, url: str, replica_rank: int) -> None:
        self.url = url
        self.replica_rank = replica_rank
        self.calls: list[str] = []

    def get_server_address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname, parts.port

    def get_calls(self) -> list[str]:
        return list(self.calls)

    async def _call(self, method: str, **kwargs) -> None:
        self.calls.append(method)
        async with RolloutClient(self.url, timeout_s=30.0) as client:
            await getattr(client, method)(**kwargs)

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self._call("pause_generation", mode="abort")

    async def resume_generation(self) -> None:
        await self._call("continue_generation")

    async def release_kv_cache(self) -> None:
        await self._call("release_memory_occupation", tags=["kv_cache"])

    async def resume_kv_cache(self) -> None:
        await self._call("resume_memory_occupation", tags=["kv_cache"])
        await self._call("flush_cache")

    async def clear_kv_cache(self) -> None:
        await self._call("flush_cache")

    async def sleep(self) -> None:
        # STANDALONE replicas release only the KV cache on sleep (verl's SGLang server).
        await self.release_kv_cache()

    async def wake_up(self) -> None:
        await self._call("resume_memory_occupation", tags=["kv_cache"])
