"""The replica's process group, and the command loop of TP ranks 1..N-1.

Every rank joins one process group (gloo on CPU, NCCL on CUDA) through rank 0's TCP store;
its world group carries the model's collectives. A second, gloo group carries commands from
rank 0 (``broadcast_object_list``) and replies back (``gather_object``); it waits
indefinitely between commands, so an idle replica never times out.

Ranks 1..N-1 run ``python -m weightsync.server.ranks.follower --tp-rank R --store-port P
--bootstrap-url URL``, reading the replica's `ServeConfig` as one JSON line on stdin. Rank 0
keeps their stdin open for as long as it lives: end of file means rank 0 is gone, and the
rank exits at once. The kernel also kills a rank when rank 0 dies (its parent-death signal,
`weightsync.server.lifetime`), which holds even while the rank is stuck in native code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from weightsync.server.config import ServeConfig
from weightsync.server.lifetime import (
    PARENT_PID_ENV,
    ParentGoneError,
    exit_with_parent,
    parent_pid_from_env,
)
from weightsync.server.logs import configure_logging
from weightsync.server.ranks.commands import INTERNAL, RankReply, Shutdown

if TYPE_CHECKING:
    from weightsync.server.ranks.runtime import RankRuntime

# Named explicitly: this module runs as __main__ in ranks 1..N-1.
logger = logging.getLogger("weightsync.server.ranks.follower")

# Between two commands a follower rank waits on the control group; an idle replica must not
# time out there. (Rank 0 going away is noticed through stdin, not through this timeout.)
_CONTROL_TIMEOUT = timedelta(days=3650)


def init_replica_group(
    config: ServeConfig, *, tp_rank: int, store: dist.Store
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
    """Join the replica's process group (every rank calls this, with the same config).

    Returns:
        ``(model_group, control_group)``: the group of the model's collectives (``None`` at
        ``tp_size == 1``) and the gloo group for commands.
    """
    backend = "gloo"
    device_id = None
    if config.device == "cuda":
        backend = "nccl"
        gpu = config.gpu_id(tp_rank)
        torch.cuda.set_device(gpu)
        device_id = torch.device("cuda", gpu)
    dist.init_process_group(
        backend,
        store=store,
        rank=tp_rank,
        world_size=config.tp_size,
        timeout=timedelta(seconds=config.collective_timeout_s),
        device_id=device_id,
    )
    control_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    model_group = dist.group.WORLD if config.tp_size > 1 else None
    return model_group, control_group


def follow(runtime: RankRuntime, control_group: dist.ProcessGroup) -> None:
    """Execute rank 0's commands until it sends `Shutdown` (ranks 1..N-1)."""
    while True:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=control_group)
        command = box[0]
        reply = runtime.execute(command)
        dist.gather_object(reply, None, dst=0, group=control_group)
        if isinstance(command, Shutdown):
            return


def _exit_when_parent_goes(fd: int) -> None:
    # Rank 0 holds the write end of our stdin; EOF means it exited (or was killed). Raw
    # reads: a daemon thread must not hold the lock of the buffered sys.stdin at exit.
    while os.read(fd, 65536):
        pass
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    """Entry point of TP ranks 1..N-1 (started by rank 0, never by hand)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--bootstrap-url", required=True)
    args = parser.parse_args(argv)
    # Rank 0 stops this process in order (or it sees EOF on stdin); a Ctrl-C or a kill of
    # the whole process group must not cut it off in the middle of a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # SIGTERM is ignored, so rank 0's death must kill.
    parent_pid = parent_pid_from_env(os.environ.get(PARENT_PID_ENV))
    if parent_pid is not None:
        try:
            exit_with_parent(parent_pid, sig=signal.SIGKILL)
        except ParentGoneError as exc:
            print(f"tp rank {args.tp_rank}: {exc}", file=sys.stderr)
            return 3
    config = ServeConfig(**json.loads(sys.stdin.readline()))
    configure_logging(config.log_level, tp_rank=args.tp_rank)
    threading.Thread(
        target=_exit_when_parent_goes, args=(sys.stdin.fileno(),), name="parent-watch", daemon=True
    ).start()
    torch.set_num_threads(config.num_threads)

    # Imported here so that a rank reports its start before the slow imports.
    from weightsync.server.ranks.runtime import RankRuntime

    store = dist.TCPStore(
        config.local_host,
        args.store_port,
        config.tp_size,
        is_master=False,
        timeout=timedelta(seconds=config.collective_timeout_s),
    )
    model_group, control_group = init_replica_group(config, tp_rank=args.tp_rank, store=store)
    try:
        runtime = RankRuntime.start(
            config, tp_rank=args.tp_rank, bootstrap_url=args.bootstrap_url, group=model_group
        )
    except Exception as exc:
        logger.exception("start-up failed")
        reply = RankReply(tp_rank=args.tp_rank, error=str(exc), error_kind=INTERNAL)
        dist.gather_object(reply, None, dst=0, group=control_group)
        return 1
    try:
        dist.gather_object(
            RankReply(tp_rank=args.tp_rank, value=runtime.info()), None, dst=0, group=control_group
        )
        follow(runtime, control_group)
    finally:
        runtime.close()
    dist.destroy_process_group()
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
