"""Predict a sync on a cluster we do not have: the network schedule against two baselines.

`predict_sync` lays out the rollout (`simulate_targets`, `traffic_units`), places the
trainer's tensors (`simulated_holders`), builds the network schedule once
(`network_schedule`), simulates it and the round-robin schedule on the same model, and
prices a broadcast. Everything here is pure; the clock readings only report how long
planning took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.layout import hf_tensor_shapes, model_dtype
from weightsync.layout.dtypes import dtype_size
from weightsync.plan import served_targets, simulate_targets
from weightsync.predict.cluster import TrainerShape, simulated_holders
from weightsync.predict.network import NetworkModel
from weightsync.predict.schedule import DEFAULT_WINDOWS, network_schedule, round_robin_schedule
from weightsync.predict.simulator import (
    SimulationResult,
    ideal_lower_bound_s,
    lower_bound_s,
    simulate,
)
from weightsync.predict.traffic import (
    TrafficGroup,
    TrafficUnit,
    fp8_num_bytes,
    is_fp8_weight,
    traffic_units,
)
from weightsync.predict.transfers import Schedule


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncPrediction:
    """What the model predicts for one sync.

    Attributes:
        schedule: the network schedule.
        result: its simulation.
        lower_bound_s: what no execution of the schedule beats (`lower_bound_s`).
        ideal_lower_bound_s: what no schedule beats (`ideal_lower_bound_s`).
        round_robin: the round-robin schedule's simulation.
        round_robin_lower_bound_s: its own lower bound.
        broadcast_s: a pipelined broadcast of every full tensor (`broadcast_seconds`).
        num_bytes: bytes the network schedule moves.
        plan_s: wall-clock seconds to build the network schedule (layout to order).
        plan_cpu_s: CPU seconds of the same.
        network: the network model it ran on.
        groups: the layout groups of the rollout ranks (`traffic_units`).
        units: the work units the schedule carries (`traffic_units`).
    """

    schedule: Schedule
    result: SimulationResult
    lower_bound_s: float
    ideal_lower_bound_s: float
    round_robin: SimulationResult
    round_robin_lower_bound_s: float
    broadcast_s: float
    num_bytes: int
    plan_s: float
    plan_cpu_s: float
    network: NetworkModel
    groups: tuple[TrafficGroup, ...] = field(hash=False)
    units: tuple[TrafficUnit, ...] = field(hash=False)

    @property
    def ratio(self) -> float:
        """Predicted makespan over the schedule's lower bound."""
        return self.result.makespan_s / self.lower_bound_s if self.lower_bound_s else 1.0


def is_fp8_config(hf_config: Any) -> bool:
    """Whether the config ships FP8 weights (``quantization_config.quant_method == "fp8"``)."""
    data = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    quantization = data.get("quantization_config") or {}
    return quantization.get("quant_method") == "fp8"


def broadcast_seconds(
    hf_config: Any, network: NetworkModel, *, dtype: Any = None, fp8: bool = False
) -> float:
    """A pipelined broadcast (NCCL ring or tree) of every full HF tensor to every rollout GPU.

    Every rollout GPU receives every tensor whole and keeps its slice: at best the model's
    bytes at one NIC's rate, however many GPUs receive, plus one message latency per tensor.
    """
    shapes = hf_tensor_shapes(hf_config)
    size = dtype_size(dtype if dtype is not None else model_dtype(hf_config))
    total = 0
    for name, shape in shapes.items():
        numel = 1
        for dim in shape:
            numel *= dim
        total += fp8_num_bytes(shape) if fp8 and is_fp8_weight(name, shape) else numel * size
    return total / network.nic_bytes_per_s + len(shapes) * network.message_latency_s


def predict_sync(
    hf_config: Any,
    *,
    trainer: TrainerShape,
    rollout_tp: int,
    rollout_ep: int = 1,
    replicas: int = 1,
    network: NetworkModel | None = None,
    fp8: bool = False,
    dtype: Any = None,
    num_windows: int = DEFAULT_WINDOWS,
    attn_dp: int = 1,
    fused_shared_experts: bool = False,
    moe_dense_tp_size: int | None = None,
    dp_lm_head: bool = False,
) -> SyncPrediction:
    """Build, simulate and compare the schedule of one sync.

    Args:
        hf_config: the model's transformers config or config.json dict.
        trainer: how the trainer's GPUs split the model.
        rollout_tp: tensor-parallel size of each replica.
        rollout_ep: expert-parallel size of each replica (divides `rollout_tp`).
        replicas: rollout replicas; rollout GPU ``r * rollout_tp + k`` is rank ``k`` of ``r``.
        network: the network model; default `NetworkModel()`.
        fp8: FP8 rollout bytes for the decoder projections (`traffic_units`).
        dtype: the rollout dtype; default the config's.
        num_windows: the schedule's layer windows.
        attn_dp, fused_shared_experts, moe_dense_tp_size, dp_lm_head: each replica's SGLang
            layout settings, as `weightsync.plan.simulate_targets` takes them.

    Raises:
        ValueError: a shape the layout rules or the trainer shape reject, or settings SGLang
            refuses.
    """
    network = network or NetworkModel()
    wall, cpu = time.perf_counter(), time.process_time()
    targets = simulate_targets(
        hf_config,
        tp=rollout_tp,
        ep=rollout_ep,
        replicas=replicas,
        dtype=dtype,
        attn_dp=attn_dp,
        fused_shared_experts=fused_shared_experts,
        moe_dense_tp_size=moe_dense_tp_size,
        dp_lm_head=dp_lm_head,
    )
    # As `build_plan` does: the fused shared experts are read off the published parameters.
    targets, problems = served_targets(hf_config, targets)
    if problems:
        raise ValueError("; ".join(problems))
    groups, units = traffic_units(hf_config, targets, dtype=dtype, fp8=fp8)
    holders = simulated_holders(units, trainer)
    schedule = network_schedule(groups, units, holders, network, num_windows=num_windows)
    plan_s, plan_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    replica_of = [index // rollout_tp for index in range(len(targets))]
    round_robin = round_robin_schedule(
        groups, units, holders, replica_of=replica_of, num_windows=num_windows
    )
    return SyncPrediction(
        schedule=schedule,
        result=simulate(schedule, network),
        lower_bound_s=lower_bound_s(schedule, network),
        ideal_lower_bound_s=ideal_lower_bound_s(groups, network),
        round_robin=simulate(round_robin, network),
        round_robin_lower_bound_s=lower_bound_s(round_robin, network),
        broadcast_s=broadcast_seconds(hf_config, network, dtype=dtype, fp8=fp8),
        num_bytes=schedule.num_bytes,
        plan_s=plan_s,
        plan_cpu_s=plan_cpu_s,
        network=network,
        groups=groups,
        units=units,
    )
