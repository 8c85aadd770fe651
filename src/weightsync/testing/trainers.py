"""Trainer ranks for the benchmarks: spawned processes with synthetic weights and two syncs.

Each rank joins one process group (gloo, or NCCL with ``device="cuda"``), generates its
pipeline stage's seeded synthetic weights (`weightsync.testing.synthetic`) and builds a P2P
`weightsync.TrainerSync` and a broadcast-baseline `BroadcastSync` over the same replicas. The
bench process then asks for syncs by method; around every sync rank 0 snapshots the
replicas' weights, overwrites them with random values, and after it requires every parameter
to equal the snapshot bit for bit.

    with SyncTrainers(spec) as trainers:
        result = trainers.run("p2p")   # rank 0's report, as a dict, and the wall time
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

METHODS = ("p2p", "p2p-nodigest", "baseline", "from-tensor")
"""The syncs a bench compares by default: weightsync (``p2p``), the same without the
senders' digests (``p2p-nodigest``: what verification costs the trainer side), the broadcast
baseline, and the colocated baseline (``from-tensor``: SGLang's ``update_weights_from_tensor``,
buckets shared by reference, as verl's ``naive`` backend; replicas on the trainer's host).
``p2p-delta`` (weightsync with ``SyncConfig(delta=True)``) is built when asked for."""
ALL_METHODS = (*METHODS, "p2p-delta")
_RESULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSpec:
    """What every trainer rank needs.

    Attributes:
        config: the model's config.json dict.
        urls: the replicas' main servers.
        api_key: their API key.
        world_size: trainer ranks.
        pp_size: pipeline stages the ranks export (rank r is stage ``r % pp_size``).
        rollout_dtype: the replicas' dtype name.
        trainer_dtype: the dtype the trainer holds its weights in.
        device: ``cpu`` or ``cuda`` (rank r on GPU r).
        seed: the synthetic weights' seed (the replicas' ``--seed``).
        bucket_bytes: both methods' bucket size.
        num_workers: P2P fill threads per rank.
        timeout_s: transfer and broadcast timeout.
        transport: the P2P transport: ``mooncake`` or ``cuda_ipc``.
        ipc_streams: CUDA IPC streams one write is spread over.
        fused_experts: the trainer holds each layer's experts as two fused tensors
            (`weightsync.testing.synthetic.synthetic_export`).
        methods: the syncs to build (`ALL_METHODS`).
        direct: the P2P senders' `SenderConfig.direct`.
        lr: the learning rate of `SyncTrainers.step` (AdamW on the trainer's weights).
    """

    config: dict[str, Any]
    urls: tuple[str, ...]
    api_key: str | None
    world_size: int
    pp_size: int = 1
    rollout_dtype: str = "bfloat16"
    trainer_dtype: str = "bfloat16"
    device: str = "cpu"
    seed: int = 0
    bucket_bytes: int = 256 << 20
    num_workers: int = 4
    timeout_s: float = 600.0
    transport: str = "mooncake"
    ipc_streams: int = 1
    fused_experts: bool = True
    methods: tuple[str, ...] = field(default=METHODS)
    direct: str = "auto"
    lr: float = 1e-6


def check_weights(urls: Sequence[str], action: str, api_key: str | None = None) -> None:
    """Run a ``weights_checker`` action (or ``pause_generation``) on every replica at once.

    Raises:
        RemoteReplicaError: it failed on a replica (``compare``: a parameter differs from the
            snapshot).
    """
    from weightsync.control import RolloutClient

    def call(client: RolloutClient) -> Any:
        if action == "pause_generation":
            return client.pause_generation()
        return client.weights_checker(action)

    async def run() -> None:
        clients = [RolloutClient(url, api_key=api_key, timeout_s=600.0) for url in urls]
        try:
            await asyncio.gather(*(call(c) for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    asyncio.run(run())


def _syncs(spec: TrainerSpec, group: Any, rank: int) -> dict[str, Any]:
    import weightsync as ws
    from weightsync.baseline import BroadcastConfig, BroadcastSync, TensorSync
    from weightsync.manager import SyncManager

    syncs: dict[str, Any] = {}
    for method in ("p2p", "p2p-nodigest", "p2p-delta"):
        if method not in spec.methods:
            continue
        transport: ws.MooncakeConfig | ws.CudaIpcConfig = ws.MooncakeConfig(
            protocol="tcp", timeout_s=spec.timeout_s
        )
        if spec.transport == "cuda_ipc":
            transport = ws.CudaIpcConfig(device=rank, num_streams=spec.ipc_streams)
        config = ws.SyncConfig(
            sender=ws.SenderConfig(
                bucket_bytes=spec.bucket_bytes,
                num_workers=spec.num_workers,
                timeout_s=spec.timeout_s,
                digest=method != "p2p-nodigest",
                direct=spec.direct,
            ),
            control=ws.ControlConfig(api_key=spec.api_key, http_timeout_s=600.0),
            transport=transport,
            delta=method == "p2p-delta",
        )
        syncs[method] = ws.TrainerSync(
            config,
            hf_config=spec.config,
            group=group,
            replicas=spec.urls,
            dtype=spec.rollout_dtype,
        )
    for method, kind in (("baseline", BroadcastSync), ("from-tensor", TensorSync)):
        if method not in spec.methods:
            continue
        manager = None
        if rank == 0:
            manager = SyncManager(
                spec.urls, ws.ControlConfig(api_key=spec.api_key, http_timeout_s=600.0)
            )
        syncs[method] = kind(
            hf_config=spec.config,
            config=BroadcastConfig(bucket_bytes=spec.bucket_bytes, timeout_s=spec.timeout_s),
            group=group,
            manager=manager,
            dtype=spec.rollout_dtype,
        )
    return syncs


def trainer_main(
    rank: int, spec: TrainerSpec, init_method: str, commands: Any, results: Any
) -> None:
    """One trainer rank: build the syncs, then run the syncs the bench process asks for."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    syncs: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        from weightsync.testing.synthetic import synthetic_export

        cuda = spec.device == "cuda"
        device = f"cuda:{rank}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=spec.world_size,
        )
        t0 = time.perf_counter()
        export = synthetic_export(
            spec.config,
            seed=spec.seed,
            dtype=spec.trainer_dtype,
            device=device,
            pp_rank=rank % spec.pp_size,
            pp_size=spec.pp_size,
            fused_experts=spec.fused_experts,
        )
        generate_s = time.perf_counter() - t0
        syncs = _syncs(spec, dist.group.WORLD, rank)
        results.put({"kind": "ready", "rank": rank, "generate_s": generate_s})
        stepper: _Steps | None = None
        while (command := commands.get())["kind"] != "stop":
            if command["kind"] == "loop":
                results.put(_loop(spec, syncs[command["method"]], export, command["count"], rank))
                continue
            if command["kind"] == "step":
                stepper = stepper or _Steps(export, spec.lr, seed=spec.seed + 1000 * (rank + 1))
                results.put({"kind": "step", "rank": rank, "seconds": stepper.step()})
                continue
            check = command.get("check", True)
            if rank == 0 and check:
                # Corrupting weights is for paused replicas; the sync resumes them.
                check_weights(spec.urls, "pause_generation", spec.api_key)
                check_weights(spec.urls, "snapshot", spec.api_key)
                check_weights(spec.urls, "reset_tensors", spec.api_key)
            start = time.perf_counter()
            report = syncs[command["method"]].sync(export)
            wall_s = time.perf_counter() - start
            event: dict[str, Any] = {"kind": "run", "rank": rank}
            if rank == 0:
                if check:
                    # Raises (and so fails the run) unless every parameter equals the snapshot.
                    check_weights(spec.urls, "compare", spec.api_key)
                event.update(
                    report=report.to_dict(),
                    wall_s=wall_s,
                    bit_exact=check,
                    replica_digest_s=replica_digest_seconds(spec.urls, spec.api_key),
                )
            results.put(event)
    except BaseException as exc:
        results.put(
            {"kind": "error", "rank": rank, "message": str(exc), "trace": traceback.format_exc()}
        )
    finally:
        for sync in syncs.values():
            try:
                sync.close()
            except Exception:
                traceback.print_exc()
        results.put({"kind": "exit", "rank": rank})


class _Steps:
    """AdamW steps on a rank's exported weights, in place, with Gaussian gradients (the
    weights' storage stays where the export has it, so the syncs see each step). One
    optimizer per tensor, stepped in turn, so that only one gradient exists at a time."""

    def __init__(self, export: Any, lr: float, *, seed: int) -> None:
        import torch

        self._torch = torch
        tensors = []
        seen: set[int] = set()
        for _, tensor in export:
            base = tensor._base if tensor._base is not None else tensor
            if id(base) not in seen:
                seen.add(id(base))
                tensors.append(base)
        self._params = [torch.nn.Parameter(t, requires_grad=True) for t in tensors]
        self._optimizers = [
            torch.optim.AdamW([p], lr=lr, weight_decay=0.0, foreach=False) for p in self._params
        ]
        self._generator = torch.Generator(device=tensors[0].device).manual_seed(seed)

    def step(self) -> float:
        """One step, finished on the device; its seconds."""
        torch = self._torch
        start = time.perf_counter()
        for param, optimizer in zip(self._params, self._optimizers, strict=True):
            param.grad = torch.randn(
                param.shape, generator=self._generator, device=param.device, dtype=param.dtype
            ).mul_(1e-3)
            optimizer.step()
            param.grad = None
        device = self._params[0].device
        if device.type == "cuda":
            # A GPU runs the step after the host has queued it: without waiting, the sync
            # that follows would wait for it at its first look at the device and count the
            # optimizer's time as its own.
            torch.cuda.synchronize(device)
        return time.perf_counter() - start


def _loop(spec: TrainerSpec, sync: Any, export: Any, count: int, rank: int) -> dict[str, Any]:
    """`count` syncs back to back, as an RL loop runs them (each verified by the replicas'
    digests at its end); the replicas are snapshotted before and compared after, so the
    loop's result is checked bit for bit too. Rank 0's event holds every sync's report."""
    if rank == 0:
        check_weights(spec.urls, "pause_generation", spec.api_key)
        check_weights(spec.urls, "snapshot", spec.api_key)
    reports = []
    for _ in range(count):
        report = sync.sync(export)
        reports.append(report.to_dict())
    event: dict[str, Any] = {"kind": "loop", "rank": rank}
    if rank == 0:
        check_weights(spec.urls, "compare", spec.api_key)
        event.update(reports=reports, bit_exact=True)
    return event


def replica_digest_seconds(urls: Sequence[str], api_key: str | None = None) -> float:
    """The slowest replica's digest seconds in its last session (what verification costs
    the replica side)."""
    from weightsync.control import RolloutClient

    async def run() -> float:
        clients = [RolloutClient(url, api_key=api_key, timeout_s=60.0) for url in urls]
        try:
            infos = await asyncio.gather(*(c.get_server_info() for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        return max(
            float(i.get("weightsync", {}).get("session", {}).get("last_digest_s", 0.0))
            for i in infos
        )

    return asyncio.run(run())


class SyncTrainers:
    """The trainer ranks of `spec` as spawned processes, driven by `run` (see the module).

    Raises:
        RuntimeError: a rank failed to start (with its traceback).
    """

    def __init__(self, spec: TrainerSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spec = spec
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(spec.world_size)]
        init = f"tcp://127.0.0.1:{_free_port()}"
        self.processes = [
            ctx.Process(
                target=trainer_main,
                args=(rank, spec, init, self.commands[rank], self.results),
                daemon=True,
            )
            for rank in range(spec.world_size)
        ]
        for process in self.processes:
            process.start()
        try:
            ready = [self._next("ready") for _ in self.processes]
        except BaseException:
            self.close()
            raise
        self.generate_s = max(r["generate_s"] for r in ready)

    def run(self, method: str, *, check: bool = True) -> dict[str, Any]:
        """One sync by `method` (one of `ALL_METHODS`), verified bit-exact unless not
        `check`: rank 0's ``report`` (`SyncReport.to_dict`, every rank's push in
        ``report["sources"]``) and ``wall_s``. The check overwrites the replicas' weights
        with random values first (a delta sync then has no base: it checks itself).

        Raises:
            RuntimeError: a rank failed (with its traceback), or the check failed.
        """
        for commands in self.commands:
            commands.put({"kind": "run", "method": method, "check": check})
        events = sorted((self._next("run") for _ in self.commands), key=lambda e: e["rank"])
        return events[0]

    def step(self) -> float:
        """One AdamW step (``spec.lr``, Gaussian gradients) on every rank's weights; the
        slowest rank's seconds."""
        for commands in self.commands:
            commands.put({"kind": "step"})
        return max(self._next("step")["seconds"] for _ in self.commands)

    def loop(self, method: str, count: int) -> list[dict[str, Any]]:
        """`count` syncs by `method` back to back, with no corruption in between (each is
        verified by the replicas' digests, and the result bit for bit after the last):
        rank 0's reports.

        Raises:
            RuntimeError: a rank failed (with its traceback), or the check failed.
        """
        for commands in self.commands:
            commands.put({"kind": "loop", "method": method, "count": count})
        events = sorted((self._next("loop") for _ in self.commands), key=lambda e: e["rank"])
        return events[0]["reports"]

    def close(self) -> None:
        """Stop every rank (killing what does not stop)."""
        for commands in self.commands:
            with contextlib.suppress(Exception):
                commands.put({"kind": "stop"})
        deadline = time.monotonic() + 60.0
        for process in self.processes:
            # Waited on by pid, not `join`: a rank that shared CPU tensors by file started
            # torch's shm manager, which inherits the sentinel pipe `join` waits on and
            # outlives the rank, so `join` would sit out its whole timeout.
            while process.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if process.exitcode is None:
                process.kill()
                process.join()

    def __enter__(self) -> SyncTrainers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next(self, kind: str) -> dict[str, Any]:
        deadline = time.monotonic() + _RESULT_TIMEOUT_S
        while True:
            try:
                event = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"trainer ranks failed or hung (dead: {dead})") from None
                continue
            if event["kind"] == "error":
                raise RuntimeError(f"trainer rank {event['rank']} failed:\n{event['trace']}")
            if event["kind"] == kind:
                return event


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
