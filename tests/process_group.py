"""Run a function on every rank of a real process group, in spawned processes; collect results.

``fn(rank, group, *args)`` must be a module-level function (the children import it by name);
its return value travels back pickled. Children use one CPU thread each; with the NCCL
backend, rank ``r`` uses GPU ``r``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _child(
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: multiprocessing.Queue,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            result = fn(rank, dist.group.WORLD, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_in_process_group(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Call ``fn(rank, group, *args)`` on ``world_size`` spawned ranks; results by rank.

    ``group`` is the whole world's process group, of ``backend`` (``"gloo"`` or ``"nccl"``).

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died.
        TimeoutError: not every rank answered within ``timeout_s``.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    collected: dict[int, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "store")
        processes = [
            context.Process(
                target=_child,
                args=(rank, world_size, init_file, backend, fn, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            deadline = time.monotonic() + timeout_s
            while len(collected) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} "
                        f"did not finish within {timeout_s} s"
                    )
                try:
                    rank, ok, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        rank
                        for rank, process in enumerate(processes)
                        if rank not in collected and process.exitcode not in (None, 0)
                    ]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died without a result") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                collected[rank] = pickle.loads(payload)
            for process in processes:
                process.join(timeout=30)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
    return [collected[rank] for rank in range(world_size)]
