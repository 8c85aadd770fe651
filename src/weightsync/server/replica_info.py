"""`ReplicaInfo`: what a replica tells about itself that does not change while it serves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync import __version__
from weightsync.checkpoint import load_config_dict
from weightsync.layout.config import model_dims
from weightsync.server.config import ServeConfig
from weightsync.server.http import ControlError
from weightsync.server.ranks.commands import RankInfo


class ReplicaInfo:
    """Server arguments and every rank's transfer-engine info and parallelism config.

    Args:
        config: the replica's config.
        ranks: every rank's info, by TP rank (collected once all ranks serve).
        port: the main server's bound port.
        bootstrap_port: the bootstrap server's bound port.
    """

    def __init__(
        self, config: ServeConfig, *, ranks: Sequence[RankInfo], port: int, bootstrap_port: int
    ) -> None:
        self._config = config
        self.hf_config = load_config_dict(config.model_path)
        self._fp8_block = model_dims(self.hf_config).fp8_block_size
        self._ranks = list(ranks)
        self._port = port
        self._bootstrap_port = bootstrap_port

    @property
    def num_ranks(self) -> int:
        """How many TP ranks the replica has."""
        return len(self._ranks)

    @property
    def serves_deltas(self) -> bool:
        """Whether every rank registered a delta region."""
        return all(info.delta_region for info in self._ranks)

    def delta_region_bytes(self, rank: int) -> int:
        """The size of rank `rank`'s delta region (0: it has none)."""
        region = self._ranks[rank].delta_region
        return region[1] if region else 0

    def param_names(self, rank: int) -> frozenset[str]:
        """The names of rank `rank`'s parameters."""
        return frozenset(self._ranks[rank].weights_info)

    def server_args(self) -> dict[str, Any]:
        """The ``/server_info`` fields that describe how the server runs."""
        config = self._config
        return {
            "model_path": config.model_path,
            "tp_size": config.tp_size,
            "pp_size": 1,
            "ep_size": config.ep_size,
            "dtype": self._ranks[0].dtype,
            # SGLang's key, and the block of a block-FP8 checkpoint: a trainer quantises
            # its weights to what the replica serves.
            "quantization": "fp8" if self._fp8_block else None,
            "weight_block_size": [self._fp8_block] * 2 if self._fp8_block else None,
            "device": config.device,
            "host": config.host,
            "port": self._port,
            "engine_info_bootstrap_port": self._bootstrap_port,
            "transport": config.transport,
            "mooncake_protocol": config.mooncake_protocol,
            "api_key_required": config.api_key is not None,
            "version": __version__,
            # SGLang 0.5.23's keys for its parallel layout, resolved as it resolves them:
            # `--dp-size N --enable-dp-attention` is `attn_dp_size = N` in one model copy
            # (`dp_size` 1), and `enable_dp_attention` reports `attn_dp_size > 1`.
            "dp_size": 1,
            "attn_dp_size": config.attn_dp_size,
            "enable_dp_attention": config.attn_dp_size > 1,
            "enable_dp_lm_head": config.enable_dp_lm_head,
            "moe_dense_tp_size": config.moe_dense_tp_size,
            "enforce_shared_experts_fusion": config.enforce_shared_experts_fusion,
            "disable_shared_experts_fusion": config.disable_shared_experts_fusion,
            # SGLang's keys for what this server never does: clients read them to refuse
            # replicas that move their weights.
            "enable_memory_saver": False,
            "enable_weights_cpu_backup": False,
            "cpu_offload_gb": 0,
        }

    def transfer_engine_info(self, rank: int | None) -> dict[str, Any]:
        """``{"rank", "remote_instance_transfer_engine_info": [session_id, weights_info],
        "registered_regions", "scratch_region", "delta_region"}``.

        Raises:
            ControlError: 400 for a missing or unknown rank.
        """
        if rank is None or rank < 0:
            raise ControlError("Missing or invalid rank parameter", status_code=400)
        if rank >= len(self._ranks):
            raise ControlError(
                f"Failed to get transfer engine info for rank {rank}: this replica has ranks "
                f"0..{len(self._ranks) - 1}",
                status_code=400,
            )
        info = self._ranks[rank]
        return {
            "rank": rank,
            "remote_instance_transfer_engine_info": [info.session_id, info.weights_info],
            "registered_regions": info.regions,
            "scratch_region": info.scratch_region,
            "delta_region": info.delta_region,
        }

    def parallelism_config(self, rank: int) -> dict[str, Any]:
        """Rank `rank`'s parallelism config.

        Raises:
            ControlError: 400 for a negative rank, 404 for a rank the replica does not have.
        """
        if rank < 0:
            raise ControlError(f"Invalid rank parameter {rank}", status_code=400)
        if rank >= len(self._ranks):
            raise ControlError(
                f"No parallelism config for rank {rank}: this replica has "
                f"{len(self._ranks)} rank(s)",
                status_code=404,
            )
        return dict(self._ranks[rank].parallelism)
