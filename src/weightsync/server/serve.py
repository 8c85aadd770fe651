"""`serve`: run one reference rollout replica until SIGINT / SIGTERM (rank 0's process).

Start-up, in order: bind both ports (0 picks a free one); start the bootstrap server; start
the TP rendezvous store and ranks 1..N-1; in the engine thread, join the process group, load
the model, register its memory, publish to the bootstrap server and collect every rank's
info; then start the main server, print where it listens and write the ready file.
Every socket the replica listens on is bound to the configured host (the rendezvous store and
gloo to `ServeConfig.local_host`), except Mooncake's, which listen on every interface (see
`ServeConfig`).
Shut-down: stop the main server, tell every rank to close its transport and exit, stop the
bootstrap server; a rank that does not exit in time is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI

from weightsync.checkpoint import load_config_dict
from weightsync.control.loops import event_loop_factory
from weightsync.cuda_events import IpcEvents
from weightsync.server.app import create_main_app
from weightsync.server.bootstrap import BootstrapRegistry, create_bootstrap_app
from weightsync.server.config import ServeConfig
from weightsync.server.connections import ConnectionLimits
from weightsync.server.controller import ReplicaController
from weightsync.server.direct_protocol import direct_protocol
from weightsync.server.extensions import load_extensions
from weightsync.server.http import limit_body_size
from weightsync.server.limits import GenerationBounds
from weightsync.server.logs import configure_logging
from weightsync.server.ranks.children import RankProcesses
from weightsync.server.ranks.commands import Shutdown
from weightsync.server.ranks.driver import EngineDriver
from weightsync.server.replica_info import ReplicaInfo

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to `serve` (two servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(config: ServeConfig) -> int:
    """Run a replica until SIGINT or SIGTERM; return the process exit code (0 after a
    requested stop, 1 when the replica failed to start or a rank died).

    Raises:
        OSError: a port cannot be bound.
        ValueError: the model's config.json is missing, or has no context length
            (``max_position_embeddings``).
    """
    configure_logging(config.log_level, tp_rank=0, after_replies=True)
    torch.set_num_threads(config.num_threads)
    bounds = GenerationBounds.of_model(
        load_config_dict(config.model_path), max_new_tokens_limit=config.max_new_tokens_limit
    )
    _pin_group_sockets(config)
    main_sock = _bind(config.host, config.port)
    boot_sock = _bind(config.host, config.bootstrap_port)
    # The bootstrap socket listens at once: ranks may publish before uvicorn accepts.
    boot_sock.listen(128)
    replica = _Replica(config, bounds=bounds, main_sock=main_sock, boot_sock=boot_sock)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(config.event_loop)) as runner:
            code = runner.run(replica.run())
    finally:
        main_sock.close()
        boot_sock.close()
    if not replica.engine_stopped:
        # The engine thread is stuck in a collective with a rank that is gone; nothing is
        # left to clean up in this process.
        logger.error("engine thread did not stop; exiting")
        logging.shutdown()
        os._exit(code or 1)
    return code


class _Replica:
    def __init__(
        self,
        config: ServeConfig,
        *,
        bounds: GenerationBounds,
        main_sock: socket.socket,
        boot_sock: socket.socket,
    ):
        self.config = config
        self.bounds = bounds
        self.main_sock = main_sock
        self.boot_sock = boot_sock
        self.host = _url_host(config.host)
        self.port = main_sock.getsockname()[1]
        self.bootstrap_port = boot_sock.getsockname()[1]
        self.driver: EngineDriver | None = None
        self._stop: asyncio.Event | None = None
        self._failed = False

    @property
    def engine_stopped(self) -> bool:
        return self.driver is None or self.driver.join(0)

    def request_stop(self, reason: str, *, failed: bool = False) -> None:
        """Begin shutting down (on the event loop's thread)."""
        assert self._stop is not None
        if not self._stop.is_set():
            logger.info("stopping: %s", reason)
        self._failed |= failed
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop, f"received {signal.Signals(sig).name}")
        bootstrap_url = f"http://{self.host}:{self.bootstrap_port}"
        registry = BootstrapRegistry()
        boot_server = _server(
            create_bootstrap_app(
                registry,
                api_key=self.config.api_key,
                max_body_bytes=self.config.max_bootstrap_body_bytes,
            ),
            _connection_limits(self.config),
        )
        boot_task = asyncio.create_task(boot_server.serve(sockets=[self.boot_sock]))
        logger.info("bootstrap server on %s", bootstrap_url)

        store = _rendezvous_store(self.config)
        children = RankProcesses(self.config, store_port=store.port, bootstrap_url=bootstrap_url)
        children.start()
        watchers = [
            asyncio.create_task(self._watch(rank, process))
            for rank, process in children.processes.items()
        ]
        self.driver = EngineDriver(
            self.config,
            store=store,
            bootstrap_url=bootstrap_url,
            on_failure=lambda exc: loop.call_soon_threadsafe(
                lambda: self.request_stop(f"engine failed: {exc}", failed=True)
            ),
        )
        ready = asyncio.wrap_future(self.driver.start())
        stopped = asyncio.create_task(self._stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)

        controller = main_server = main_task = None
        if ready.done() and ready.exception() is None:
            info = ReplicaInfo(
                self.config,
                ranks=ready.result(),
                port=self.port,
                bootstrap_port=self.bootstrap_port,
            )
            controller = ReplicaController(
                self.driver,
                info=info,
                weight_version=self.config.weight_version,
                bounds=self.bounds,
                fused_lifecycle=self.config.fused_lifecycle,
                events=IpcEvents(torch.device("cuda", self.config.gpu_id(0)))
                if self.config.device == "cuda"
                else None,
                # Over CUDA IPC every writer is on this host and can wait for a rank's event.
                fence=self.config.device == "cuda" and self.config.transport == "cuda_ipc",
            )
            controller.start()
            app = create_main_app(
                controller,
                api_key=self.config.api_key,
                extensions=load_extensions(self.config.extensions),
            )
            limit_body_size(
                app, self.config.max_body_bytes, setting="weightsync serve --max-body-bytes"
            )
            main_server = _server(app, _connection_limits(self.config))
            self.main_sock.listen(128)
            main_task = asyncio.create_task(main_server.serve(sockets=[self.main_sock]))
            self._announce()
            await stopped
        elif ready.done():
            self.request_stop(f"the replica could not start: {ready.exception()}", failed=True)
        ready.cancel()

        if controller is not None and main_server is not None and main_task is not None:
            await controller.stop()
            main_server.should_exit = True
            await main_task
            await self._stop_engine()
        for watcher in watchers:
            watcher.cancel()
        # Serving ranks got Shutdown and are exiting; ranks still starting are closed at once
        # (EOF on stdin), which also unblocks an engine thread waiting for them.
        await asyncio.to_thread(children.stop, _STOP_TIMEOUT_S if controller else 0.0)
        await asyncio.to_thread(self.driver.join, 5.0)
        boot_server.should_exit = True
        await boot_task
        logger.info("stopped")
        return 1 if self._failed else 0

    async def _stop_engine(self) -> None:
        """Tell every rank to close its transport and leave its command loop."""
        assert self.driver is not None
        if not self.driver.stopped:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.wrap_future(self.driver.submit(Shutdown())), _STOP_TIMEOUT_S
                )

    async def _watch(self, tp_rank: int, process) -> None:
        code = await asyncio.to_thread(process.wait)
        if self._stop is not None and not self._stop.is_set():
            logger.error("tp rank %d exited with code %s", tp_rank, code)
            self.request_stop(f"tp rank {tp_rank} exited", failed=True)

    def _announce(self) -> None:
        url = f"http://{self.host}:{self.port}"
        print(
            f"weightsync serve: listening on {url} (bootstrap :{self.bootstrap_port})",
            flush=True,
        )
        logger.info("serving %s at tp=%d on %s", self.config.model_path, self.config.tp_size, url)
        if self.config.ready_file:
            info = {
                "url": url,
                "bootstrap_url": f"http://{self.host}:{self.bootstrap_port}",
                "host": self.config.host,
                "port": self.port,
                "bootstrap_port": self.bootstrap_port,
                "tp_size": self.config.tp_size,
                "pid": os.getpid(),
            }
            path = Path(self.config.ready_file)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, path)


def _connection_limits(config: ServeConfig) -> ConnectionLimits:
    return ConnectionLimits(
        max_connections=config.max_connections,
        unauthenticated_timeout_s=config.unauthenticated_timeout_s,
        max_connections_setting="weightsync serve --max-connections",
        timeout_setting="weightsync serve --unauthenticated-timeout-s",
    )


def _server(app: FastAPI, limits: ConnectionLimits) -> _Server:
    return _Server(
        uvicorn.Config(
            app,
            # Every request is judged from its head before its body is read, within the
            # connection limits; the fused lifecycle calls are answered from the bytes.
            http=direct_protocol(app, limits=limits),
            # Clients connect directly; a forwarded-for header must not rename them.
            proxy_headers=False,
            log_config=None,
            lifespan="off",
            timeout_graceful_shutdown=5,
            access_log=True,
        )
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it a reply written in two pieces (headers,
    # then body) waits for the client's delayed ACK: ~40 ms per control call on keep-alive
    # connections, a third of a second per sync.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from exc
    return sock


def _rendezvous_store(config: ServeConfig) -> dist.TCPStore:
    """Rank 0's TCP store, listening on `config.local_host` only.

    Given a host, torch's TCPStore still listens on every interface; handed a socket that is
    already bound and listening, it serves on that one.
    """
    sock = _bind(config.local_host, 0)
    sock.listen(max(128, config.tp_size))
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here on
    try:
        return dist.TCPStore(
            config.local_host,
            port,
            config.tp_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=config.collective_timeout_s),
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        os.close(fd)
        raise


def _pin_group_sockets(config: ServeConfig) -> None:
    """Make gloo, in rank 0 and in the ranks it starts, listen on the interface that holds
    `config.local_host` (gloo takes an interface name, from ``GLOO_SOCKET_IFNAME``; without
    one it binds the address the machine's hostname resolves to). A ``GLOO_SOCKET_IFNAME``
    already set is left as it is."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface = _interface_of(config.local_host)
        if interface is None:
            logger.warning(
                "no network interface holds %s; gloo (the TP group's collectives) listens on "
                "the interface of this machine's hostname. Set GLOO_SOCKET_IFNAME to choose",
                config.local_host,
            )
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if config.device == "cuda" and not os.environ.get("NCCL_SOCKET_IFNAME"):
        logger.warning(
            "NCCL's bootstrap listens on the interface NCCL picks; set NCCL_SOCKET_IFNAME "
            "(e.g. '=lo' on one machine) to keep it on %s",
            config.local_host,
        )


def _interface_of(host: str) -> str | None:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return None
    for interface, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.address.split("%", 1)[0] in addresses:
                return interface
    return None


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
