"""`VerlOptions`: the backend's settings, read from verl's
``checkpoint_engine.engine_kwargs.weightsync`` (or ``.p2p``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

TRANSPORTS: tuple[str, ...] = ("tcp", "rdma", "auto", "cuda_ipc")
# `weightsync.manager.config.DELTA_WHEN`, which verl's import of these options must not load
# (tests/verl_host/checks.py checks both the import's cost and that the two agree).
DELTA_WHEN: tuple[str, ...] = ("always", "faster")
MIB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlOptions:
    """What the weightsync backend does in a verl job.

    Every key of ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync``
    is one attribute here (Hydra: ``+...engine_kwargs.weightsync.<key>=<value>``).

    Attributes:
        model_path: the HF model folder (or its ``config.json``) the trainer trains; the
            plan reads the architecture from it. Set it to ``${actor_rollout_ref.model.path}``.
        update_weights_bucket_megabytes: MiB of one staging slot on every actor rank; None:
            verl's ``checkpoint_engine.update_weights_bucket_megabytes``.
        check_weight_update_equal: corrupt every replica's weights before the first sync
            and require the first sync to restore them bit-exactly.
        check_weight_update_allow_quant_error: let that check accept one quantised ULP.
        transfer_num_workers: threads that fill each staging slot.
        transfer_timeout_s: how long one batch of writes may take before it fails.
        transport: ``tcp``, ``rdma`` or ``auto`` (Mooncake TransferEngine) or ``cuda_ipc``
            (actor and rollout GPUs on one host).
        api_key: sent to the replicas as ``Authorization: Bearer`` (SGLang's ``api_key``).
        server_actor_name: how the rollout's per-node server actors are named in Ray, with
            ``{replica_rank}`` and ``{node_rank}``; stock verl's replicas are found by it.
        lifecycle_timeout_s: deadline of each control-plane call to a replica.
        delta: write only what changed since the last sync into replicas that prove they
            hold it (``SyncConfig.delta``); SGLang as released proves it, and takes the
            delta, when started with ``--custom-weight-loader
            weightsync.integrations.sglang.apply_delta``, and takes full bytes otherwise.
        delta_when: ``always`` or ``faster`` (``ControlConfig.delta_when``): with
            ``faster`` a replica takes a delta only while its measured deltas beat its
            measured full writes, so colocated rollouts (``cuda_ipc``) stay on full bytes.

    Raises:
        ValueError: an unknown key, a value of the wrong type or out of range, or a
            ``model_path`` without a ``config.json``; the message names the key.
    """

    model_path: str
    update_weights_bucket_megabytes: int | None = None
    check_weight_update_equal: bool = False
    check_weight_update_allow_quant_error: bool = False
    transfer_num_workers: int = 4
    transfer_timeout_s: float = 30.0
    transport: str = "tcp"
    api_key: str | None = None
    server_actor_name: str = "sglang_server_{replica_rank}_{node_rank}"
    lifecycle_timeout_s: float = 30.0
    delta: bool = False
    delta_when: str = "always"

    def __post_init__(self) -> None:
        where = "checkpoint_engine.engine_kwargs.weightsync"
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(
                f"{where}.model_path is required: the trained model's HF folder "
                "(set it to ${{actor_rollout_ref.model.path}})"
            )
        mb = self.update_weights_bucket_megabytes
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise ValueError(
                f"{where}.update_weights_bucket_megabytes must be a positive integer, got {mb!r}"
            )
        for name in ("check_weight_update_equal", "check_weight_update_allow_quant_error", "delta"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{where}.{name} must be true or false, got {getattr(self, name)!r}"
                )
        workers = self.transfer_num_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"{where}.transfer_num_workers must be a positive integer, got {workers!r}"
            )
        for name in ("transfer_timeout_s", "lifecycle_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (value > 0 and math.isfinite(value))
            ):
                raise ValueError(f"{where}.{name} must be a positive number, got {value!r}")
        if self.delta_when not in DELTA_WHEN:
            raise ValueError(
                f"{where}.delta_when={self.delta_when!r}: choose one of {', '.join(DELTA_WHEN)}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"{where}.transport={self.transport!r}: choose one of {', '.join(TRANSPORTS)}"
            )
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError(f"{where}.api_key must be a non-empty string or null")
        try:
            self.server_actor_name.format(replica_rank=0, node_rank=0)
        except (AttributeError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"{where}.server_actor_name={self.server_actor_name!r} must be a format string "
                "with only {replica_rank} and {node_rank}"
            ) from exc

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: dict[str, Any]) -> VerlOptions:
        """Read the options from verl's engine kwargs (the backend's own dict).

        Raises:
            ValueError: an unknown key (the known ones are listed) or a bad value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(
                f"checkpoint_engine.engine_kwargs.weightsync: unknown key(s) {unknown}; "
                f"known keys: {sorted(known)}"
            )
        if "model_path" not in engine_kwargs:
            raise ValueError(
                "checkpoint_engine.engine_kwargs.weightsync.model_path is required: the trained "
                "model's HF folder (set it to ${actor_rollout_ref.model.path})"
            )
        return cls(**engine_kwargs)

    def bucket_bytes(self, verl_bucket_bytes: int) -> int:
        """Bytes of one staging slot: this backend's setting, else verl's."""
        if self.update_weights_bucket_megabytes is not None:
            return self.update_weights_bucket_megabytes * MIB
        return verl_bucket_bytes

    def hf_config(self) -> dict[str, Any]:
        """The model's ``config.json``, as a dict.

        Raises:
            ValueError: no ``config.json`` at `model_path`, or one that does not parse.
        """
        path = Path(self.model_path)
        config_file = path if path.name == "config.json" else path / "config.json"
        try:
            return json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"checkpoint_engine.engine_kwargs.weightsync.model_path={self.model_path!r}: "
                f"cannot read {config_file}: {exc}"
            ) from exc
