"""`RankRuntime`: one TP rank of the reference engine: model, transport, agent, commands."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync.checkpoint import load_config_dict
from weightsync.engine import ReferenceModel, generate
from weightsync.engine.synthetic import synthetic_hf_tensors
from weightsync.layout import model_dtype
from weightsync.receiver.agent import RolloutAgent, SessionState, UpdateSessionError
from weightsync.receiver.loader import load_hf_tensors
from weightsync.server.config import MIB, ServeConfig
from weightsync.server.extensions import RankContext, ServerExtension, load_extensions
from weightsync.server.ranks.commands import (
    CONFLICT,
    INTERNAL,
    INVALID,
    OUT_OF_MEMORY,
    REFUSED,
    ApplyDelta,
    BeginUpdate,
    CheckWeights,
    Command,
    DeltaChecksums,
    EndUpdate,
    FlushCache,
    Generate,
    RankInfo,
    RankReply,
    SetWeightVersion,
    Shutdown,
)
from weightsync.server.ranks.memory import describe_out_of_memory, is_out_of_memory
from weightsync.torch_dtypes import dtype_name
from weightsync.transport import (
    CudaIpcConfig,
    MooncakeConfig,
    Transport,
    open_transport,
    register_tensor,
)

logger = logging.getLogger(__name__)

# The scratch region each rank registers beside its parameters, so that a client can test
# a write and read it back through the real transport without touching a weight
# (``weightsync doctor``). Its address is served, like every parameter's, with the API key.
SCRATCH_BYTES = 4096


def rank_transport(config: ServeConfig, device: torch.device) -> Transport:
    """The transport a rank registers its parameters with: Mooncake, or CUDA IPC on the
    rank's own GPU. Its session id is published the same way for both.

    Raises:
        ValueError: the transport cannot reach memory on `device` (a Mooncake build without
            CUDA, asked for GPU memory).
    """
    if config.transport == "cuda_ipc":
        index = device.index if device.index is not None else 0
        return open_transport(CudaIpcConfig(device=index))
    transport = open_transport(
        MooncakeConfig(protocol=config.mooncake_protocol, hostname=_advertised_host(config))
    )
    if not transport.capabilities.reads(device.type, device.index):
        transport.close()
        raise ValueError(
            f"this Mooncake build cannot reach {device} memory: serve with --device cpu, "
            "--transport cuda_ipc (trainer on the same host), or install a CUDA build of "
            "Mooncake (mooncake-transfer-engine)"
        )
    return transport


def _advertised_host(config: ServeConfig) -> str:
    """The address trainers reach this rank's transfer engine at (part of its session id):
    the configured host, or for a wildcard the address this machine's name resolves to."""
    if config.host not in ("0.0.0.0", "::", ""):
        return config.host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class GenerationRefusedError(RuntimeError):
    """Generation was asked for while a weight-update session is open."""


class RankRuntime:
    """Everything one rank of a reference replica owns, and how it executes commands.

    Built by `start` on every rank (rank 0 in its driver thread, the others in their own
    processes), after the replica's process group exists. Its memory is registered once; the
    parameters never move or get freed while it lives (there is no weight offload).

    Args:
        tp_rank: this rank.
        model: the loaded model.
        transport: the rank's transport, owned by the runtime (closed by `close`).
        agent: the rank's agent over the model's parameters.
        collective_timeout_s: how long a collective of a server extension may wait.
        extensions: the server extensions whose commands this rank runs.
        scratch_bytes: size of the scratch region registered beside the parameters for test
            writes (`SCRATCH_BYTES` over Mooncake); 0 for none.
    """

    def __init__(
        self,
        *,
        tp_rank: int,
        model: ReferenceModel,
        transport: Transport,
        agent: RolloutAgent,
        collective_timeout_s: float = 600.0,
        extensions: Sequence[ServerExtension] = (),
        scratch_bytes: int = 0,
    ) -> None:
        self.tp_rank = tp_rank
        self.model = model
        self.transport = transport
        self.agent = agent
        self.extensions = {
            command_type: extension
            for extension in extensions
            for command_type in extension.command_types
        }
        self._extensions = list(extensions)
        # Never a parameter: no plan targets it, no digest covers it, no session tracks it.
        self.scratch_region: tuple[int, int] | None = None
        if scratch_bytes:
            self._scratch = torch.zeros(scratch_bytes, dtype=torch.uint8, device=model.device)
            self.scratch_region = register_tensor(transport, self._scratch)
        self.context = RankContext(
            tp_rank=tp_rank,
            params=dict(model.named_parameters()),
            hf_config=model.hf_config,
            parallelism=model.parallelism,
            device=model.device,
            collective_timeout_s=collective_timeout_s,
        )

    @classmethod
    def start(
        cls,
        config: ServeConfig,
        *,
        tp_rank: int,
        bootstrap_url: str,
        group: dist.ProcessGroup | None,
    ) -> RankRuntime:
        """Build the rank's model, load the checkpoint, register its memory with a new
        transport and publish the rank to the bootstrap server.

        Args:
            config: the replica's config.
            tp_rank: this rank.
            bootstrap_url: the replica's bootstrap server.
            group: the TP process group (``None`` at ``tp_size == 1``).
        """
        hf_config = load_config_dict(config.model_path)
        parallelism = config.parallelism(hf_config, tp_rank)
        device = f"cuda:{config.gpu_id(tp_rank)}" if config.device == "cuda" else "cpu"
        dtype = config.dtype or model_dtype(hf_config)
        logger.info(
            "building %s model (dtype %s) on %s: %s",
            hf_config["model_type"],
            dtype,
            device,
            parallelism,
        )
        model = ReferenceModel(hf_config, parallelism, dtype=dtype, device=device, group=group)
        if config.load_format == "dummy":
            # Seeded synthetic weights, tensor by tensor: the bytes a trainer generating with
            # the same seed holds, without a checkpoint file.
            load_hf_tensors(
                dict(model.named_parameters()),
                synthetic_hf_tensors(hf_config, seed=config.seed, dtype=dtype, device=device),
                hf_config,
                parallelism,
                dtype,
            )
            # What the engine derives from the loaded weights (DeepSeek's w_kc / w_vc).
            model.post_load()
            source = f"synthetic weights (seed {config.seed})"
        else:
            model.load_checkpoint(config.model_path)
            source = config.model_path
        model.eval()
        if model.device.type == "cuda":
            # Trainers write into these parameters from other processes (CUDA IPC) once the
            # rank is published: the loading kernels must be done before then.
            torch.cuda.synchronize(model.device)
        num_bytes = sum(p.nbytes for p in model.parameters())
        logger.info("loaded %s: %.1f MB of parameters", source, num_bytes / 1e6)
        transport = rank_transport(config, model.device)
        try:
            agent = RolloutAgent(
                params=dict(model.named_parameters()),
                parallelism=parallelism,
                transport=transport,
                on_update_end=model.post_load,
                # post_load derives MLA's w_kc / w_vc beside the parameters, never in them.
                post_load_writes_params=False,
                weight_version=config.weight_version,
                delta_region_bytes=config.delta_region_mb * MIB,
            )
        except BaseException:
            transport.close()
            raise
        try:
            runtime = cls(
                tp_rank=tp_rank,
                model=model,
                transport=transport,
                agent=agent,
                collective_timeout_s=config.collective_timeout_s,
                extensions=load_extensions(config.extensions),
                # Over CUDA IPC the trainer shares the host: there is no network path to test.
                scratch_bytes=SCRATCH_BYTES if config.transport == "mooncake" else 0,
            )
        except BaseException:
            try:
                agent.close()
            finally:
                transport.close()
            raise
        try:
            agent.publish(bootstrap_url, api_key=config.api_key)
        except BaseException:
            runtime.close()
            raise
        logger.info(
            "registered %d parameters in %d region(s) with transfer engine %s; published to %s",
            len(agent.weights_info()),
            agent.registered_regions,
            agent.session_id,
            bootstrap_url,
        )
        return runtime

    def info(self) -> RankInfo:
        """What rank 0 needs to answer the main server's per-rank routes."""
        return RankInfo(
            tp_rank=self.tp_rank,
            session_id=self.agent.session_id,
            weights_info=self.agent.weights_info(),
            parallelism=self.agent.parallelism.to_dict(),
            device=str(self.model.device),
            dtype=dtype_name(self.model.dtype),
            regions=[list(region) for region in self.agent.regions],
            scratch_region=list(self.scratch_region) if self.scratch_region else None,
            delta_region=list(self.agent.delta_region) if self.agent.delta_region else None,
        )

    def execute(self, command: Command) -> RankReply:
        """Run one command on this rank; failures become an error reply, never an exception,
        so every rank always reaches the reply gather."""
        try:
            value = self._dispatch(command)
        except GenerationRefusedError as exc:
            return self._error(REFUSED, exc)
        except UpdateSessionError as exc:
            return self._error(CONFLICT, exc)
        except ValueError as exc:
            return self._error(INVALID, exc)
        except Exception as exc:
            logger.exception("%s failed", type(command).__name__)
            if is_out_of_memory(exc):
                # The caller can act on this one (free memory, skip parameters): the reply
                # says so, with the sizes, and no other text of the failure.
                return RankReply(
                    tp_rank=self.tp_rank,
                    error=describe_out_of_memory(
                        exc, what=_doing(command), tp_rank=self.tp_rank, device=self.model.device
                    ),
                    error_kind=OUT_OF_MEMORY,
                )
            # The traceback is in this rank's log; replies carry no engine internals.
            return RankReply(
                tp_rank=self.tp_rank,
                error=f"{type(exc).__name__} on tp rank {self.tp_rank}; see the server log",
                error_kind=INTERNAL,
            )
        return RankReply(tp_rank=self.tp_rank, value=value)

    def close(self) -> None:
        """Close what the server extensions hold here, unregister the parameters' memory and
        close the transport."""
        try:
            for extension in self._extensions:
                extension.close(self.context)
            self.agent.close()
        finally:
            self.transport.close()

    def _dispatch(self, command: Command) -> Any:
        match command:
            case Generate():
                # Checked on every rank, in command order, so no token is ever generated
                # from half-written weights even if the request raced with begin.
                if self.agent.session_open:
                    raise GenerationRefusedError(
                        "a weight-update session is open; generation resumes after "
                        "end_weight_update"
                    )
                output_ids = generate(
                    self.model,
                    list(command.input_ids),
                    max_new_tokens=command.max_new_tokens,
                    temperature=command.temperature,
                    seed=command.seed,
                )
                return {"output_ids": output_ids, "weight_version": self.agent.weight_version}
            case BeginUpdate(selector=selector, fence=fence):
                return self.agent.begin_update(selector, fence=fence)  # type: ignore[arg-type]
            case EndUpdate(expected=expected, landed=False, gated=gated):
                mine = expected[self.tp_rank] if self.tp_rank < len(expected) else None
                return self.agent.prepare_end(mine, gated=gated)
            case EndUpdate(expected=expected, version=version):
                if version is not None:
                    self.agent.set_weight_version(version)
                mine = expected[self.tp_rank] if self.tp_rank < len(expected) else None
                # The digests a first send of this command put in order, kept by the agent.
                prepared = mine is not None and self.agent.session_state is SessionState.ENDING
                return self.agent.end_update(mine, prepared=prepared)
            case SetWeightVersion(version=version):
                self.agent.set_weight_version(version)
                return None
            case CheckWeights():
                return self.agent.weights_checker(
                    command.action,
                    allow_quant_error=command.allow_quant_error,
                    skip_tensor_list=command.skip_tensor_list,
                )
            case DeltaChecksums():
                return self.agent.delta_checksums()
            case ApplyDelta(payloads=payloads, expected=expected, check=check):
                return self.agent.apply_delta(
                    payloads[self.tp_rank], expected[self.tp_rank], check=check
                )
            case FlushCache(empty_device_cache=empty_device_cache):
                # The engine keeps no prefix cache across requests (each request's KV cache
                # is its own); what remains is returning cached allocator memory. No
                # gc.collect(): it costs ~0.2 s with torch loaded, on every sync's resume.
                if empty_device_cache and self.model.device.type == "cuda":
                    torch.cuda.empty_cache()
                return None
            case Shutdown():
                return None
        extension = self.extensions.get(type(command))
        if extension is not None:
            return extension.execute(command, self.context)
        raise ValueError(f"unknown command {command!r}")

    def _error(self, kind: str, exc: BaseException) -> RankReply:
        return RankReply(
            tp_rank=self.tp_rank, error=str(exc) or type(exc).__name__, error_kind=kind
        )


def _doing(command: Command) -> str:
    """What a rank does for `command`, as a failure names it (``"weights_checker compare"``)."""
    match command:
        case CheckWeights(action=action):
            return f"weights_checker {action}"
        case Generate():
            return "generate"
    return type(command).__name__
