"""`weightsync plan --simulate`: predict a sync's data phase on a cluster we do not have.

With ``--delta-density``, also a delta sync on the same schedule (`weightsync.predict.delta`):
its payload bytes on the wire, the senders' encoding and the replicas' checksums and apply.
"""

from __future__ import annotations

import importlib.util
import json
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from weightsync.layout import normalize_hf_config
from weightsync.layout.families import family_for
from weightsync.predict import (
    FP8_CODE_DENSITY_RATIO,
    DeltaDensity,
    DeltaPrediction,
    NetworkModel,
    Port,
    SyncPrediction,
    TrainerShape,
    delta_prediction,
    is_fp8_config,
    predict_sync,
)

PRESETS: tuple[str, ...] = (
    "kimi-k2",
    "deepseek-v3",
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "dense-70b",
)
DEFAULT_ROLLOUT_TP = 8
DEFAULT_TRAINER_PP = 4

# The delta options, declared once for every command that simulates.
DeltaDensityOption = Annotated[
    float | None,
    typer.Option(
        "--delta-density",
        help="--simulate: also predict a delta sync in which this fraction of bf16 (and other "
        "non-FP8) elements changed, e.g. 0.02 (measured: 2-4 % per step at lr 1e-6).",
    ),
]
DeltaFp8CodeDensityOption = Annotated[
    float | None,
    typer.Option(
        "--delta-fp8-code-density",
        help=f"--simulate: the fraction of FP8 codes changed (default: --delta-density x "
        f"{FP8_CODE_DENSITY_RATIO:g}, as measured).",
    ),
]
DeltaFp8ScaleDensityOption = Annotated[
    float | None,
    typer.Option(
        "--delta-fp8-scale-density",
        help="--simulate: the fraction of FP8 block scales changed (default: 1, as measured).",
    ),
]


# The rollout layout options, declared once for `weightsync plan` with and without --simulate.
RolloutDpAttentionOption = Annotated[
    int,
    typer.Option(
        "--rollout-dp-attention",
        help="Attention data-parallel groups inside each replica's TP group (SGLang's "
        "--attn-dp-size, or --dp-size N --enable-dp-attention): attention splits over "
        "TP / N ranks, MoE over the whole TP group.",
    ),
]
RolloutFusedSharedExpertsOption = Annotated[
    bool,
    typer.Option(
        "--rollout-fused-shared-experts",
        help="DeepSeek's shared experts fused into the routed experts as extra expert slots "
        "(SGLang's default for DeepSeek-V3 at pure TP on H100/H200; "
        "--enforce-shared-experts-fusion).",
    ),
]
RolloutMoeDenseTpSizeOption = Annotated[
    int | None,
    typer.Option(
        "--rollout-moe-dense-tp-size",
        help="SGLang's --moe-dense-tp-size: 1 replicates the dense MLP layers (SGLang "
        "accepts only 1 or the TP size).",
    ),
]
RolloutDpLmHeadOption = Annotated[
    bool,
    typer.Option(
        "--rollout-dp-lm-head",
        help="SGLang's --enable-dp-lm-head: lm_head splits over attention TP (needs "
        "--rollout-dp-attention).",
    ),
]


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutLayout:
    """The SGLang layout settings of every simulated replica.

    Attributes:
        dp_attention: attention data-parallel groups inside the TP group (1: none).
        fused_shared_experts: DeepSeek's shared experts fused into the routed experts.
        moe_dense_tp_size: ``--moe-dense-tp-size`` (None: not set).
        dp_lm_head: ``--enable-dp-lm-head``.
    """

    dp_attention: int = 1
    fused_shared_experts: bool = False
    moe_dense_tp_size: int | None = None
    dp_lm_head: bool = False

    def simulate_kwargs(self) -> dict[str, Any]:
        """These settings as `weightsync.plan.simulate_targets` takes them."""
        return {
            "attn_dp": self.dp_attention,
            "fused_shared_experts": self.fused_shared_experts,
            "moe_dense_tp_size": self.moe_dense_tp_size,
            "dp_lm_head": self.dp_lm_head,
        }

    def summary(self) -> dict[str, Any]:
        """These settings for a JSON summary."""
        return {
            "dp_attention": self.dp_attention,
            "fused_shared_experts": self.fused_shared_experts,
            "moe_dense_tp_size": self.moe_dense_tp_size,
            "dp_lm_head": self.dp_lm_head,
        }

    def describe(self) -> str:
        """``" dp-attention 2 fused-shared-experts"``: what differs from plain TP/EP."""
        parts = []
        if self.dp_attention > 1:
            parts.append(f"dp-attention {self.dp_attention}")
        if self.dp_lm_head:
            parts.append("dp-lm-head")
        if self.fused_shared_experts:
            parts.append("fused-shared-experts")
        if self.moe_dense_tp_size is not None:
            parts.append(f"moe-dense-tp {self.moe_dense_tp_size}")
        return "".join(f" {part}" for part in parts)


def check_rollout_layout(config: dict[str, Any], tp: int, layout: RolloutLayout) -> None:
    """Reject rollout layout settings SGLang would not run, naming the option.

    Raises:
        SimulateOptionError: a width below 1 or not dividing `tp`, a dense-MLP TP size other
            than 1 or `tp`, a DP lm_head without attention DP, or fused shared experts for a
            model without DeepSeek's shared experts.
    """
    if layout.dp_attention < 1 or tp % layout.dp_attention:
        raise SimulateOptionError(
            "--rollout-dp-attention",
            f"{layout.dp_attention} must be at least 1 and divide --rollout-tp {tp}",
        )
    if layout.moe_dense_tp_size not in (None, 1, tp):
        raise SimulateOptionError(
            "--rollout-moe-dense-tp-size",
            f"{layout.moe_dense_tp_size}: SGLang accepts only 1 or the TP size ({tp})",
        )
    if layout.dp_lm_head and layout.dp_attention == 1:
        raise SimulateOptionError(
            "--rollout-dp-lm-head", "needs attention DP: add --rollout-dp-attention N (N > 1)"
        )
    if layout.fused_shared_experts:
        try:
            fusable = family_for(config["model_type"]).deepseek_moe and bool(
                normalize_hf_config(config).get("n_shared_experts")
            )
        except ValueError as exc:
            raise SimulateOptionError("--model-config", f"{exc}") from exc
        if not fusable:
            raise SimulateOptionError(
                "--rollout-fused-shared-experts",
                f"{config['model_type']} has no DeepSeek shared experts to fuse",
            )


class SimulateOptionError(Exception):
    """A command-line value that cannot work; `option` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulateOptions:
    """The cluster as given on the command line (None: the default rule applies).

    Attributes:
        trainer_gpus, trainer_tp, trainer_ep: the trainer's GPUs and model-parallel sizes.
        trainer_pp, trainer_dp: pipeline stages and data-parallel copies, or None.
        rollout_gpus: rollout GPUs.
        rollout_tp, rollout_ep, replicas: each replica's sizes and their number, or None.
        rollout_layout: each replica's SGLang layout settings (attention DP, fused shared
            experts, dense-MLP TP, DP lm_head).
        nic_gbps, gpus_per_node, nics_per_node: the network.
        fp8: FP8 rollout bytes; None: as the config ships.
        num_windows: the schedule's layer windows.
        plot: where to write the timeline PNG, or None.
        delta_density: predict a delta sync too, at this fraction of bf16 (and other
            non-FP8) elements changed; None: the full sync only.
        delta_fp8_code_density, delta_fp8_scale_density: the FP8 codes' and scales'
            fractions; None: derived as measured (`DeltaDensity.measured`).
    """

    trainer_gpus: int
    trainer_tp: int
    trainer_ep: int
    trainer_pp: int | None
    trainer_dp: int | None
    rollout_gpus: int
    rollout_tp: int | None
    rollout_ep: int | None
    replicas: int | None
    nic_gbps: float
    gpus_per_node: int
    nics_per_node: int
    fp8: bool | None
    num_windows: int
    plot: Path | None
    delta_density: float | None = None
    delta_fp8_code_density: float | None = None
    delta_fp8_scale_density: float | None = None
    rollout_layout: RolloutLayout = RolloutLayout()


def run_simulation(
    config: dict[str, Any], options: SimulateOptions, *, label: str, as_json: bool
) -> None:
    """Resolve the cluster, predict the sync and print it (a table, or one JSON object).

    Raises:
        SimulateOptionError: a value that cannot work, naming its option.
    """
    if options.plot is not None and importlib.util.find_spec("matplotlib") is None:
        # Before minutes of planning, not after.
        raise SimulateOptionError("--plot", "needs matplotlib: pip install 'weightsync[plot]'")
    cluster = _resolve(config, options)
    density = _delta_density(options)
    try:
        network = NetworkModel(
            nic_gbps=options.nic_gbps,
            gpus_per_node=options.gpus_per_node,
            nics_per_node=options.nics_per_node,
        )
    except ValueError as exc:
        raise SimulateOptionError("--nics-per-node", f"{exc}") from exc
    try:
        prediction = predict_sync(
            config,
            trainer=cluster["trainer"],
            rollout_tp=cluster["rollout_tp"],
            rollout_ep=cluster["rollout_ep"],
            replicas=cluster["replicas"],
            network=network,
            fp8=cluster["fp8"],
            num_windows=options.num_windows,
            **options.rollout_layout.simulate_kwargs(),
        )
    except ValueError as exc:
        raise SimulateOptionError("--rollout-tp/--rollout-ep", f"{exc}") from exc
    summary = _summary(config, label, cluster, network, prediction)
    if density is not None:
        summary["delta"] = _delta_summary(delta_prediction(prediction, config, density=density))
    if options.plot is not None:
        from weightsync.cli.timeline import write_timeline

        write_timeline(prediction, options.plot, title=_title(summary))
        summary["plot"] = str(options.plot)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        _print(summary)


def _resolve(config: dict[str, Any], o: SimulateOptions) -> dict[str, Any]:
    for option, value in (
        ("--trainer-gpus", o.trainer_gpus),
        ("--trainer-tp", o.trainer_tp),
        ("--trainer-ep", o.trainer_ep),
        ("--rollout-gpus", o.rollout_gpus),
        ("--windows", o.num_windows),
    ):
        if value < 1:
            raise SimulateOptionError(option, f"must be at least 1, got {value}")
    if not o.nic_gbps > 0:
        raise SimulateOptionError("--nic-gbps", f"must be > 0, got {o.nic_gbps}")
    try:
        dims = normalize_hf_config(config)
        moe = family_for(config["model_type"]).moe
    except ValueError as exc:
        raise SimulateOptionError("--model-config", f"{exc}") from exc
    for option, given in (
        ("--rollout-tp", o.rollout_tp),
        ("--rollout-ep", o.rollout_ep),
        ("--replicas", o.replicas),
        ("--trainer-pp", o.trainer_pp),
        ("--trainer-dp", o.trainer_dp),
    ):
        if given is not None and given < 1:
            raise SimulateOptionError(option, f"must be at least 1, got {given}")
    rollout_tp = o.rollout_tp or min(DEFAULT_ROLLOUT_TP, o.rollout_gpus)
    if o.rollout_gpus % rollout_tp:
        raise SimulateOptionError(
            "--rollout-tp", f"{rollout_tp} does not divide --rollout-gpus {o.rollout_gpus}"
        )
    replicas = o.rollout_gpus // rollout_tp
    if o.replicas is not None and o.replicas != replicas:
        raise SimulateOptionError(
            "--replicas",
            f"{o.replicas} replicas of tp {rollout_tp} are not --rollout-gpus {o.rollout_gpus}; "
            f"pass --rollout-gpus {o.replicas * rollout_tp}",
        )
    check_rollout_layout(config, rollout_tp, o.rollout_layout)
    heads = dims["num_attention_heads"]
    attn_tp = rollout_tp // o.rollout_layout.dp_attention
    if heads % attn_tp:
        raise SimulateOptionError(
            "--rollout-tp",
            f"{attn_tp} attention-TP ranks (--rollout-tp / --rollout-dp-attention) do not "
            f"divide the model's num_attention_heads={heads}",
        )
    rollout_ep = o.rollout_ep or (rollout_tp if moe else 1)
    if rollout_tp % rollout_ep:
        raise SimulateOptionError(
            "--rollout-ep", f"{rollout_ep} must divide --rollout-tp {rollout_tp}"
        )
    mp = o.trainer_tp * o.trainer_ep
    if o.trainer_gpus % mp:
        raise SimulateOptionError(
            "--trainer-gpus",
            f"{o.trainer_gpus} is not a multiple of --trainer-tp x --trainer-ep = {mp}",
        )
    groups = o.trainer_gpus // mp
    layers = dims["num_hidden_layers"]
    pp = o.trainer_pp
    if pp is None and o.trainer_dp is not None:
        if groups % o.trainer_dp:
            raise SimulateOptionError(
                "--trainer-dp", f"{o.trainer_dp} does not divide the {groups} model-parallel groups"
            )
        pp = groups // o.trainer_dp
    if pp is None:
        pp = next(p for p in (DEFAULT_TRAINER_PP, 2, 1) if groups % p == 0 and p <= layers)
    if pp < 1 or pp > layers or groups % pp:
        raise SimulateOptionError(
            "--trainer-pp",
            f"{pp} stages must be between 1 and the model's {layers} layers and divide the "
            f"{groups} model-parallel groups of --trainer-gpus {o.trainer_gpus}",
        )
    trainer = TrainerShape(num_gpus=o.trainer_gpus, tp=o.trainer_tp, ep=o.trainer_ep, pp=pp)
    if o.trainer_dp is not None and trainer.dp != o.trainer_dp:
        raise SimulateOptionError(
            "--trainer-dp",
            f"{o.trainer_dp} copies x pp {pp} x tp {o.trainer_tp} x ep {o.trainer_ep} is not "
            f"--trainer-gpus {o.trainer_gpus}",
        )
    return {
        "trainer": trainer,
        "rollout_tp": rollout_tp,
        "rollout_ep": rollout_ep,
        "replicas": replicas,
        "fp8": is_fp8_config(config) if o.fp8 is None else o.fp8,
        "rollout_layout": o.rollout_layout,
    }


def _delta_density(o: SimulateOptions) -> DeltaDensity | None:
    """The delta densities asked for, or None for none."""
    given = (
        ("--delta-density", o.delta_density),
        ("--delta-fp8-code-density", o.delta_fp8_code_density),
        ("--delta-fp8-scale-density", o.delta_fp8_scale_density),
    )
    for option, value in given:
        if value is not None and not 0.0 <= value <= 1.0:
            raise SimulateOptionError(
                option, f"must be a fraction in [0, 1], got {value:g} (0.02: 2 % changed)"
            )
    if o.delta_density is None:
        for option, value in given[1:]:
            if value is not None:
                raise SimulateOptionError(
                    option, "prices a delta sync; add --delta-density (the bf16 fraction)"
                )
        return None
    return DeltaDensity.measured(
        o.delta_density,
        fp8_codes=o.delta_fp8_code_density,
        fp8_scales=o.delta_fp8_scale_density,
    )


def _delta_summary(delta: DeltaPrediction) -> dict[str, Any]:
    return {
        "density": asdict(delta.density),
        "bytes": delta.num_bytes,
        "byte_ratio": delta.byte_ratio,
        "num_changed": delta.num_changed,
        "num_full_transfers": delta.num_full_transfers,
        "encode_s": delta.encode_s,
        "find_s": delta.find_s,
        "host_s": delta.host_s,
        "num_tensors": delta.num_tensors,
        "layout_s": delta.layout_s,
        "wire_s": delta.wire_s,
        "wire_lower_bound_s": delta.wire_lower_bound_s,
        "replica_s": delta.replica_s,
        "checksum_s": delta.checksum_s,
        "num_checksums": delta.num_checksums,
        "apply_s": delta.apply_s,
        "total_s": delta.total_s,
        "bound_by": delta.bound_by,
        "full_s": delta.full_s,
        "full_lower_bound_s": delta.full_lower_bound_s,
        "speedup_vs_full": delta.full_s / delta.total_s if delta.total_s else 0.0,
        "rates": asdict(delta.rates),
    }


def _port_name(port: Port) -> str:
    kind, node, index = port
    side = "send" if kind.endswith("tx") else "recv"
    link = "nvlink gpu" if kind.startswith("nv") else "nic"
    return f"{node} {link} {index} {side}"


def _summary(
    config: dict[str, Any],
    label: str,
    cluster: dict[str, Any],
    network: NetworkModel,
    prediction: SyncPrediction,
) -> dict[str, Any]:
    trainer: TrainerShape = cluster["trainer"]
    result, round_robin = prediction.result, prediction.round_robin
    makespan = result.makespan_s
    return {
        "model_config": label,
        "model_type": config["model_type"],
        "fp8": cluster["fp8"],
        "trainer": {
            "gpus": trainer.num_gpus,
            "tp": trainer.tp,
            "ep": trainer.ep,
            "pp": trainer.pp,
            "dp": trainer.dp,
        },
        "rollout": {
            "gpus": cluster["replicas"] * cluster["rollout_tp"],
            "replicas": cluster["replicas"],
            "tp": cluster["rollout_tp"],
            "ep": cluster["rollout_ep"],
            **cluster["rollout_layout"].summary(),
        },
        "network": {
            "nic_gbps": network.nic_gbps,
            "gpus_per_node": network.gpus_per_node,
            "nics_per_node": network.nics_per_node,
            "write_cost_s": network.write_cost_s,
            "message_latency_s": network.message_latency_s,
        },
        "bytes": prediction.num_bytes,
        "num_transfers": prediction.schedule.num_transfers,
        "makespan_s": makespan,
        "lower_bound_s": prediction.lower_bound_s,
        "ideal_lower_bound_s": prediction.ideal_lower_bound_s,
        "ratio": prediction.ratio,
        "round_robin_s": round_robin.makespan_s,
        "round_robin_lower_bound_s": prediction.round_robin_lower_bound_s,
        "speedup_vs_round_robin": round_robin.makespan_s / makespan if makespan else 1.0,
        "broadcast_s": prediction.broadcast_s,
        "plan_s": prediction.plan_s,
        "plan_cpu_s": prediction.plan_cpu_s,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "busiest_ports": [
            {
                "port": _port_name(port),
                "busy_s": busy,
                "bytes": num_bytes,
                "utilization": busy / makespan if makespan else 0.0,
            }
            for port, busy, num_bytes in result.busiest(5)
        ],
    }


def _title(summary: dict[str, Any]) -> str:
    t, r = summary["trainer"], summary["rollout"]
    dtype = "FP8" if summary["fp8"] else "bf16"
    return (
        f"{summary['model_config']} ({dtype}): {t['gpus']} trainer GPUs (tp {t['tp']} ep {t['ep']} "
        f"pp {t['pp']} dp {t['dp']}) -> {r['replicas']} x tp {r['tp']} ep {r['ep']}"
        f"{_layout_words(r)}, "
        f"{summary['network']['nic_gbps']:g} Gb/s per NIC"
    )


def _layout_words(rollout: dict[str, Any]) -> str:
    return RolloutLayout(
        dp_attention=rollout["dp_attention"],
        fused_shared_experts=rollout["fused_shared_experts"],
        moe_dense_tp_size=rollout["moe_dense_tp_size"],
        dp_lm_head=rollout["dp_lm_head"],
    ).describe()


def _print(summary: dict[str, Any]) -> None:
    console = Console()
    console.print(_title(summary))
    table = Table(title="Predicted data phase")
    for column in ("plan", "predicted", "lower bound", "ratio", "vs network"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    makespan = summary["makespan_s"]
    table.add_row(
        "network schedule",
        f"{makespan:.3f} s",
        f"{summary['lower_bound_s']:.3f} s",
        f"{summary['ratio']:.3f}",
        "1.00x",
    )
    table.add_row(
        "round robin (Miles-style)",
        f"{summary['round_robin_s']:.3f} s",
        f"{summary['round_robin_lower_bound_s']:.3f} s",
        f"{summary['round_robin_s'] / summary['round_robin_lower_bound_s']:.3f}",
        f"{summary['speedup_vs_round_robin']:.2f}x slower",
    )
    table.add_row(
        "broadcast (full tensors)",
        f"{summary['broadcast_s']:.3f} s",
        "-",
        "-",
        f"{summary['broadcast_s'] / makespan:.2f}x slower" if makespan else "-",
    )
    console.print(table)
    ports = Table(title="Busiest ports (network schedule)")
    for column in ("port", "busy", "bytes", "utilization"):
        ports.add_column(column, justify="left" if column == "port" else "right")
    for port in summary["busiest_ports"]:
        ports.add_row(
            port["port"],
            f"{port['busy_s']:.3f} s",
            f"{port['bytes'] / 1e9:.2f} GB",
            f"{port['utilization']:.1%}",
        )
    console.print(ports)
    console.print(
        f"no schedule beats {summary['ideal_lower_bound_s']:.3f} s (busiest receiving NIC); "
        f"{summary['bytes'] / 1e12:.3f} TB in {summary['num_transfers']} transfers; "
        f"planned in {summary['plan_s']:.1f} s ({summary['plan_cpu_s']:.1f} s CPU)"
    )
    if "delta" in summary:
        console.print(delta_table(summary["delta"]))
        delta = summary["delta"]
        console.print(
            f"delta sync: {delta['total_s']:.3f} s, bound by its {delta['bound_by']} phase; "
            f"the full sync {delta['full_s']:.3f} s, and no full sync beats "
            f"{delta['full_lower_bound_s']:.3f} s"
        )
    if "plot" in summary:
        console.print(f"timeline written to {summary['plot']}")


def delta_table(delta: dict[str, Any]) -> Table:
    """The phases of a delta sync's summary (`_delta_summary`) beside the full sync."""
    density = delta["density"]
    table = Table(
        title=f"Predicted delta sync: {density['elements']:.2%} of elements changed, "
        f"FP8 codes {density['fp8_codes']:.2%}, scales {density['fp8_scales']:.0%}"
    )
    for column in ("phase", "seconds", "what"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    table.add_row(
        "encode",
        f"{delta['encode_s']:.3f} s",
        f"slowest trainer GPU: find changes {delta['find_s'] * 1e3:.1f} ms, "
        f"host {delta['host_s'] * 1e3:.1f} ms ({delta['num_tensors']} tensors), "
        f"lay out {delta['layout_s'] * 1e3:.1f} ms",
    )
    table.add_row(
        "wire",
        f"{delta['wire_s']:.3f} s",
        f"{delta['bytes'] / 1e9:.2f} GB ({delta['byte_ratio']:.2%} of full), lower bound "
        f"{delta['wire_lower_bound_s']:.3f} s",
    )
    table.add_row(
        "replica",
        f"{delta['replica_s']:.3f} s",
        f"slowest rollout GPU: {delta['num_checksums']} x checksum "
        f"{delta['checksum_s'] * 1e3:.1f} ms, "
        f"apply {delta['apply_s'] * 1e3:.1f} ms",
    )
    table.add_row("delta total", f"{delta['total_s']:.3f} s", f"bound by {delta['bound_by']}")
    table.add_row(
        "full sync",
        f"{delta['full_s']:.3f} s",
        f"network schedule; every byte needs at least {delta['full_lower_bound_s']:.3f} s",
    )
    return table
