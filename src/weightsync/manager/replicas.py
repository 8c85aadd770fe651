"""The replicas a manager writes to: membership, and what each one is (its client, what it
serves, which process it is, its ranks' published metadata).

Discovery is one set of functions, used by `SyncManager` and by ``weightsync doctor``:
`parallelism_of` (a replica's ranks' parallelism, from ``/parallelism_config`` or derived
as SGLang derives it) and `replica_targets` (every rank as a `TargetRank`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weightsync.checkpoint import load_config_dict
from weightsync.control import RolloutClient
from weightsync.control.models import BeginWeightUpdateResponse
from weightsync.control.protocol import (
    PARALLELISM_CONFIG,
    WEIGHT_UPDATE_DIGEST,
    WEIGHT_UPDATE_LEASE,
    ReplicaProtocol,
    derive_parallelism,
    num_ranks,
    refusal,
    served_dtype,
)
from weightsync.control.quantization import served_quantization
from weightsync.control.vllm import VLLMClient, is_vllm_server_info
from weightsync.errors import RemoteReplicaError
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.manager.update import Sessions
from weightsync.manager.versions import HeldLabel
from weightsync.plan import TargetRank

logger = logging.getLogger(__name__)

DERIVED = "derived from /server_info"


async def parallelism_of(
    client: RolloutClient, protocol: ReplicaProtocol, server_info: dict[str, Any], ranks: range
) -> tuple[list[ParallelismConfig], str]:
    """Each rank's parallelism, and where it came from: ``/parallelism_config`` where served
    (advertised, or answered for rank 0 by a server that advertises nothing, such as SGLang
    with the Miles extensions), else derived from `server_info` as SGLang derives it
    (`DERIVED`).

    Raises:
        RemoteReplicaError: a rank's config could not be fetched.
        ValueError: `server_info` does not say enough to derive it.
    """
    if protocol.kind == "sglang" and not protocol.serves(PARALLELISM_CONFIG):
        try:
            first = await client.get_parallelism_config(ranks[0])
        except RemoteReplicaError as exc:
            if exc.status_code != 404:
                raise
            return [derive_parallelism(server_info, rank) for rank in ranks], DERIVED
        rest = await asyncio.gather(*(client.get_parallelism_config(r) for r in ranks[1:]))
        # SGLang's RankParallelismConfig does not carry the dense-MLP and lm_head settings:
        # its server arguments do.
        derived = derive_parallelism(server_info, ranks[0])
        settings = {
            "moe_dense_tp_size": derived.moe_dense_tp_size,
            "enable_dp_lm_head": derived.enable_dp_lm_head,
        }
        return [dataclasses.replace(c, **settings) for c in (first, *rest)], "/parallelism_config"
    configs = await asyncio.gather(*(client.get_parallelism_config(r) for r in ranks))
    return list(configs), "/parallelism_config"


def served_checkpoint_config(server_info: dict[str, Any]) -> dict[str, Any] | None:
    """The config.json of the checkpoint a replica serves, where its ``model_path`` is a
    folder this process can read (the same host or a shared file system), else None.

    Blocking (it reads a file): call it in a thread from async code.
    """
    model_path = server_info.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        return None
    try:
        if not Path(model_path).is_dir():
            return None
        return load_config_dict(model_path)
    except (OSError, ValueError):
        return None


async def replica_targets(
    client: RolloutClient, server_info: dict[str, Any]
) -> tuple[TargetRank, ...]:
    """Every rank of the replica behind `client`, with its published metadata.

    Raises:
        RemoteReplicaError: a call failed, or the replica published something invalid
            (naming the replica and the route).
    """
    url = client.base_url
    protocol = ReplicaProtocol.from_server_info(server_info)
    try:
        ranks = range(num_ranks(server_info))
    except ValueError as exc:
        raise RemoteReplicaError(
            f"replica {url}: {exc}", replica=url, route="/server_info"
        ) from exc
    engine_infos = asyncio.gather(*(client.get_transfer_engine_reply(r) for r in ranks))
    try:
        infos, (configs, source), checkpoint_config = await asyncio.gather(
            engine_infos,
            parallelism_of(client, protocol, server_info, ranks),
            asyncio.to_thread(served_checkpoint_config, server_info),
        )
        fp8_block = served_quantization(
            server_info,
            checkpoint_config=checkpoint_config,
            weights_infos=[info.remote_instance_transfer_engine_info[1] for info in infos],
        )
    except ValueError as exc:
        raise RemoteReplicaError(
            f"replica {url}: {exc}", replica=url, route="/server_info"
        ) from exc
    if source == DERIVED:
        logger.info(
            "replica %s (%s) has no /parallelism_config: %s", url, protocol.describe(), DERIVED
        )
    dtype = served_dtype(server_info)
    return tuple(
        TargetRank(
            replica=url,
            rank=rank,
            session_id=info.remote_instance_transfer_engine_info[0],
            parallelism=config,
            weights_info={
                k: tuple(v) for k, v in info.remote_instance_transfer_engine_info[1].items()
            },
            dtype=dtype,
            fp8_block_size=fp8_block,
            regions=tuple(map(tuple, info.registered_regions))
            if info.registered_regions is not None
            else None,
            delta_region=info.delta_region,
        )
        for rank, info, config in zip(ranks, infos, configs, strict=True)
    )


def replica_instance(server_info: dict[str, Any]) -> str | None:
    """The process a replica is, where its ``/server_info`` says (the reference server's
    ``weightsync.instance``, vLLM's workers' through the extension), else None."""
    for key in ("weightsync", "weightsync_extension"):
        section = server_info.get(key)
        if isinstance(section, dict) and isinstance(section.get("instance"), str):
            return section["instance"]
    return None


def _unreachable_hint(failure: BaseException) -> str:
    """`failure`, and for a 404 on ``/server_info`` what a vLLM replica needs to serve it."""
    if (
        isinstance(failure, RemoteReplicaError)
        and failure.status_code == 404
        and failure.route.startswith("/server_info")
    ):
        return f"{failure} (a vLLM replica serves /server_info only with VLLM_SERVER_DEV_MODE=1)"
    return str(failure)


class ReplicaSet:
    """The managed replicas and what is known of each; keyed by base URL.

    A replica is a URL and a process: metadata fetched from one process is void for the
    next behind the same URL (`note_begin` notices it), and `epoch` keys the targets by
    membership and process, so a plan cached for the old process is never used for the new.

    Args:
        api_key: the bearer token every client sends.
        http_timeout_s: the clients' default deadline.
    """

    def __init__(self, *, api_key: str | None, http_timeout_s: float) -> None:
        self._api_key = api_key
        self._http_timeout_s = http_timeout_s
        self.urls: list[str] = []
        self.clients: dict[str, RolloutClient] = {}
        self.protocols: dict[str, ReplicaProtocol] = {}
        self.server_infos: dict[str, dict[str, Any]] = {}
        self.ranks: dict[str, tuple[TargetRank, ...]] = {}  # metadata, fetched once
        self.instances: dict[str, str] = {}  # each replica's process, where it says
        self._warned: set[str] = set()
        self._membership = 0  # counts membership changes
        self._epochs: dict[tuple[int, frozenset[tuple[str, str | None]]], int] = {}

    def add(self, url: str) -> None:
        """Manage `url`.

        Raises:
            ValueError: it is already managed.
        """
        url = url.rstrip("/")
        if url in self.clients:
            raise ValueError(f"replica {url} is already managed")
        self.urls.append(url)
        self.clients[url] = RolloutClient(
            url, api_key=self._api_key, timeout_s=self._http_timeout_s
        )
        self._membership += 1

    async def remove(self, url: str) -> None:
        """Forget `url` and close its client.

        Raises:
            ValueError: it is not managed.
        """
        client = self.clients.pop(url, None)
        if client is None:
            raise ValueError(f"replica {url} is not managed; managed: {self.urls}")
        self.urls.remove(url)
        for table in (self.protocols, self.server_infos, self.ranks, self.instances):
            table.pop(url, None)
        self._membership += 1
        await client.aclose()

    async def aclose(self) -> None:
        """Close every replica's client."""
        await asyncio.gather(*(c.aclose() for c in self.clients.values()))

    def epoch(self, live: Sequence[str]) -> int:
        """The epoch of a push to `live`: the same while membership and processes are."""
        key = (self._membership, frozenset((u, self.instances.get(u)) for u in live))
        return self._epochs.setdefault(key, len(self._epochs) + 1)

    async def call_all(self, replicas: Sequence[str], method: str, **kwargs: Any) -> dict[str, Any]:
        """Call client `method` on every replica at once; each one's result or exception."""
        calls = [getattr(self.clients[url], method)(**kwargs) for url in replicas]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return dict(zip(replicas, results, strict=True))

    async def first_contact(
        self, replicas: Sequence[str], dropped: dict[str, str], *, timeout_s: float
    ) -> dict[str, dict[str, Any]]:
        """Learn what each of `replicas` serves (``/server_info``, ``/model_info``, each
        within `timeout_s`); those that cannot be reached or cannot take point-to-point
        writes go into `dropped`.

        Returns:
            The ``/model_info`` of every replica learned (it says the label it serves).
        """
        timeout = timeout_s
        infos, models = await asyncio.gather(
            self.call_all(replicas, "get_server_info", timeout_s=timeout),
            self.call_all(replicas, "get_model_info", timeout_s=timeout),
        )
        vllm = [u for u in replicas if isinstance(infos[u], dict) and is_vllm_server_info(infos[u])]
        if vllm:  # vLLM speaks other routes: ask again through its own client
            await asyncio.gather(*(self._use_vllm_client(url) for url in vllm))
            again, models_again = await asyncio.gather(
                self.call_all(vllm, "get_server_info", timeout_s=timeout),
                self.call_all(vllm, "get_model_info", timeout_s=timeout),
            )
            infos.update(again)
            models.update(models_again)
        learned: dict[str, dict[str, Any]] = {}
        for url in replicas:
            info, model = infos[url], models[url]
            failure = next((r for r in (info, model) if isinstance(r, BaseException)), None)
            if failure is not None:
                dropped[url] = f"not reachable: {_unreachable_hint(failure)}"
                continue
            reason = refusal(info)
            if reason is not None:
                dropped[url] = f"cannot take point-to-point updates: {reason}"
                continue
            # New, or failed last time (it may have restarted): fetch its ranks again.
            self.ranks.pop(url, None)
            self.learn(url, info)
            instance = replica_instance(info)
            if isinstance(instance, str):
                self.instances[url] = instance
            learned[url] = model
        return learned

    async def _use_vllm_client(self, url: str) -> None:
        """Talk to `url` through a `VLLMClient` from now on (it is a vLLM replica)."""
        client = self.clients[url]
        if not isinstance(client, VLLMClient):
            self.clients[url] = VLLMClient.like(client)
            await client.aclose()

    def learn(self, url: str, server_info: dict[str, Any]) -> None:
        """Keep what replica `url` serves, from its ``/server_info``."""
        protocol = ReplicaProtocol.from_server_info(server_info)
        self.server_infos[url] = server_info
        self.protocols[url] = protocol
        self._warn_unenforced(url, protocol)

    def note_begin(self, url: str, reply: BeginWeightUpdateResponse, sessions: Sessions) -> None:
        """Keep what a begin's reply says the replica holds, and notice a new process behind
        `url` (its metadata is void: fetched again before the push)."""
        if reply.instance is None and reply.weight_version is None:
            return  # a server that does not say (SGLang): /model_info tells the label
        sessions.begun[url] = HeldLabel(
            label=reply.weight_version, highest=reply.highest_numeric_version
        )
        if reply.instance is None:
            return
        known = self.instances.get(url)
        if known is not None and known != reply.instance:
            logger.warning(
                "replica %s is a new process (instance %s, was %s): it restarted since the "
                "last update; its metadata is fetched again and it takes a full write",
                url,
                reply.instance,
                known,
            )
            self.ranks.pop(url, None)
            sessions.restarted.add(url)
        self.instances[url] = reply.instance

    async def fetch_targets(self, replicas: Sequence[str]) -> dict[str, Any]:
        """Every replica's ranks (fetched and kept), or the exception its fetch raised."""
        results = await asyncio.gather(
            *(replica_targets(self.clients[u], self.server_infos[u]) for u in replicas),
            return_exceptions=True,
        )
        fetched = dict(zip(replicas, results, strict=True))
        self.ranks.update({u: r for u, r in fetched.items() if not isinstance(r, BaseException)})
        return fetched

    def _warn_unenforced(self, url: str, protocol: ReplicaProtocol) -> None:
        """Say once per replica which guarantees this replica cannot give."""
        missing = [c for c in (WEIGHT_UPDATE_LEASE, WEIGHT_UPDATE_DIGEST) if not protocol.serves(c)]
        if not missing or url in self._warned:
            return
        self._warned.add(url)
        consequences = []
        if WEIGHT_UPDATE_LEASE in missing:
            consequences.append(
                "its sessions are not fenced (a trainer that dies mid-sync leaves it paused "
                "with a session open until a later update ends it, and another client may end "
                "or resume it)"
            )
        if WEIGHT_UPDATE_DIGEST in missing:
            consequences.append(
                "it cannot verify what arrived (a sync it reports done is not checked against "
                "the trainers' digests)"
            )
        logger.warning(
            "replica %s (%s) does not take %s: %s; this manager keeps those rules on its "
            "side: it never resumes a replica it wrote to part-way, and labels are monotonic",
            url,
            protocol.describe(),
            " or ".join(missing),
            " and ".join(consequences),
        )


class PendingChanges:
    """Membership changes asked while an update is open: each runs as the update finishes,
    and its caller waits until then."""

    def __init__(self) -> None:
        self._pending: list[tuple[Callable[[str], Any], str, asyncio.Future[None]]] = []

    async def after_update(self, change: Callable[[str], Any], url: str) -> None:
        """Queue ``change(url)`` for the end of the open update and wait for it to run.

        Raises:
            Exception: what the change raised.
        """
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((change, url, done))
        await done

    async def apply(self) -> None:
        """Run the changes asked during the update that just finished."""
        pending, self._pending = self._pending, []
        for change, url, done in pending:
            try:
                result = change(url)
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(None)
