"""`weightsync plan`: plan a sync for a simulated cluster and show who writes what."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from weightsync.checkpoint import load_config_dict
from weightsync.cli.simulate_cmd import (
    PRESETS,
    DeltaDensityOption,
    DeltaFp8CodeDensityOption,
    DeltaFp8ScaleDensityOption,
    RolloutDpAttentionOption,
    RolloutDpLmHeadOption,
    RolloutFusedSharedExpertsOption,
    RolloutLayout,
    RolloutMoeDenseTpSizeOption,
    SimulateOptionError,
    SimulateOptions,
    check_rollout_layout,
    run_simulation,
)
from weightsync.cli.timeline import PlotUnavailableError
from weightsync.errors import LayoutMismatchError
from weightsync.layout import normalize_hf_config
from weightsync.plan import SyncPlan, build_plan, simulate_sources, simulate_targets
from weightsync.plan.validate import int_ranges
from weightsync.torch_dtypes import dtype_name, torch_dtype

# Exit code for bad command-line input, as click uses for usage errors.
_USAGE_ERROR = 2


class _BadOption(Exception):
    """A command-line value that cannot work; the message says which option and what to do."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")


def plan(
    model_config: Annotated[
        str | None,
        typer.Option(
            "--model-config",
            help="A config.json, a checkpoint folder holding one, or the name of a bundled "
            "config (tiny-qwen3, or a --preset name).",
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(help=f"A bundled model instead of --model-config: {', '.join(PRESETS)}."),
    ] = None,
    rollout_tp: Annotated[
        int | None,
        typer.Option(help="Tensor-parallel size of each replica [default: 1; --simulate: 8]."),
    ] = None,
    rollout_ep: Annotated[
        int | None,
        typer.Option(
            help="Expert-parallel size (divides the TP) [default: 1; --simulate: the TP for MoE]."
        ),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(help="Rollout replicas [default: 1; --simulate: --rollout-gpus / TP]."),
    ] = None,
    rollout_dp_attention: RolloutDpAttentionOption = 1,
    rollout_fused_shared_experts: RolloutFusedSharedExpertsOption = False,
    rollout_moe_dense_tp_size: RolloutMoeDenseTpSizeOption = None,
    rollout_dp_lm_head: RolloutDpLmHeadOption = False,
    trainer_sources: Annotated[
        int, typer.Option(help="Trainer source ranks (pipeline stages x data-parallel copies).")
    ] = 1,
    trainer_pp: Annotated[
        int | None,
        typer.Option(help="Trainer pipeline stages [default: 1; --simulate: 4 where it divides]."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="Rollout dtype: bf16, fp16, fp32 or a full name; default the config's."),
    ] = None,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Predict the sync's data phase on a modelled cluster (no bytes move): the "
            "network schedule against its lower bound, round robin and a broadcast.",
        ),
    ] = False,
    trainer_gpus: Annotated[int, typer.Option(help="--simulate: trainer GPUs.")] = 256,
    trainer_tp: Annotated[int, typer.Option(help="--simulate: trainer tensor-parallel size.")] = 8,
    trainer_ep: Annotated[int, typer.Option(help="--simulate: trainer expert-parallel size.")] = 1,
    trainer_dp: Annotated[
        int | None, typer.Option(help="--simulate: trainer data-parallel copies (or from pp).")
    ] = None,
    rollout_gpus: Annotated[int, typer.Option(help="--simulate: rollout GPUs.")] = 128,
    nic_gbps: Annotated[
        float, typer.Option(help="--simulate: Gb/s per NIC and direction.")
    ] = 400.0,
    gpus_per_node: Annotated[int, typer.Option(help="--simulate: GPUs per node.")] = 8,
    nics_per_node: Annotated[int, typer.Option(help="--simulate: NICs per node.")] = 8,
    fp8: Annotated[
        bool | None,
        typer.Option(
            "--fp8/--no-fp8",
            help="--simulate: FP8 rollout bytes (weights + 128x128 block scales) [default: as "
            "the config ships].",
        ),
    ] = None,
    windows: Annotated[
        int, typer.Option(help="--simulate: layer windows the schedule keeps in order.")
    ] = 4,
    plot: Annotated[
        Path | None,
        typer.Option(help="--simulate: write a PNG timeline here (needs weightsync[plot])."),
    ] = None,
    delta_density: DeltaDensityOption = None,
    delta_fp8_code_density: DeltaFp8CodeDensityOption = None,
    delta_fp8_scale_density: DeltaFp8ScaleDensityOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Plan a weight sync from trainer sources into rollout replicas, without moving bytes.

    Simulates the cluster: `--replicas` replicas of `--rollout-tp` ranks, and
    `--trainer-sources` trainer ranks split into `--trainer-pp` pipeline stages (source rank =
    data-parallel index * pp + stage). The replicas may run SGLang's DeepSeek layouts:
    attention DP (`--rollout-dp-attention`, with `--rollout-dp-lm-head`), fused shared
    experts and `--rollout-moe-dense-tp-size`. Prints each distinct rollout layout, each
    target rank's parameters and bytes, the parameters the engine owns (left alone: FP8
    KV-cache scales), each source's share and the imbalance (max / mean bytes written per
    source).

    With `--simulate`, predicts instead the data phase of the sync on a modelled cluster of
    `--trainer-gpus` and `--rollout-gpus` GPUs at `--nic-gbps`: the network schedule's time,
    its lower bound and their ratio, the busiest ports, round robin and a broadcast; with
    `--delta-density`, also a delta sync on the same schedule, phase by phase.
    """
    if simulate:
        _simulate(
            model_config,
            preset,
            SimulateOptions(
                trainer_gpus=trainer_gpus,
                trainer_tp=trainer_tp,
                trainer_ep=trainer_ep,
                trainer_pp=trainer_pp,
                trainer_dp=trainer_dp,
                rollout_gpus=rollout_gpus,
                rollout_tp=rollout_tp,
                rollout_ep=rollout_ep,
                replicas=replicas,
                rollout_layout=RolloutLayout(
                    dp_attention=rollout_dp_attention,
                    fused_shared_experts=rollout_fused_shared_experts,
                    moe_dense_tp_size=rollout_moe_dense_tp_size,
                    dp_lm_head=rollout_dp_lm_head,
                ),
                nic_gbps=nic_gbps,
                gpus_per_node=gpus_per_node,
                nics_per_node=nics_per_node,
                fp8=fp8,
                num_windows=windows,
                plot=plot,
                delta_density=delta_density,
                delta_fp8_code_density=delta_fp8_code_density,
                delta_fp8_scale_density=delta_fp8_scale_density,
            ),
            as_json,
        )
        return
    rollout_tp = 1 if rollout_tp is None else rollout_tp
    rollout_ep = 1 if rollout_ep is None else rollout_ep
    replicas = 1 if replicas is None else replicas
    trainer_pp = 1 if trainer_pp is None else trainer_pp
    try:
        if plot is not None:
            raise _BadOption("--plot", "draws a --simulate run; add --simulate")
        if delta_density is not None:
            raise _BadOption("--delta-density", "prices a --simulate run; add --simulate")
        model_config = _config_name(model_config, preset)
        config = _read_config(model_config)
        layout = RolloutLayout(
            dp_attention=rollout_dp_attention,
            fused_shared_experts=rollout_fused_shared_experts,
            moe_dense_tp_size=rollout_moe_dense_tp_size,
            dp_lm_head=rollout_dp_lm_head,
        )
        try:
            check_rollout_layout(config, rollout_tp, layout)
        except SimulateOptionError as exc:
            raise _BadOption(exc.option, f"{exc}") from exc
        rollout_dtype = _check_options(
            config,
            rollout_tp,
            rollout_ep,
            replicas,
            trainer_sources,
            trainer_pp,
            dtype,
            attn_tp=rollout_tp // layout.dp_attention,
        )
        try:
            targets = simulate_targets(
                config,
                tp=rollout_tp,
                ep=rollout_ep,
                replicas=replicas,
                dtype=rollout_dtype,
                **layout.simulate_kwargs(),
            )
        except ValueError as exc:
            raise _BadOption("--rollout-tp/--rollout-ep", f"{exc}") from exc
        try:
            sources = simulate_sources(config, num_sources=trainer_sources, pp=trainer_pp)
        except ValueError as exc:
            raise _BadOption("--trainer-pp", f"{exc}") from exc
    except _BadOption as exc:
        _exit_with(f"error: {exc}", _USAGE_ERROR)
    try:
        sync_plan = build_plan(
            hf_config=config, targets=targets, sources=sources, dtype=rollout_dtype
        )
    except LayoutMismatchError as exc:
        _exit_with(f"error: the plan does not validate: {exc}", 1)
    except ValueError as exc:
        # A layout build_plan cannot plan yet (DeepSeek's float32 router bias beside bf16).
        _exit_with(f"error: the plan cannot be built: {exc}; --simulate plans it", 1)
    summary = {
        "model_config": model_config,
        "model_type": config["model_type"],
        "rollout": {
            "tp": rollout_tp,
            "ep": rollout_ep,
            "replicas": replicas,
            **layout.summary(),
        },
        "trainer": {"sources": trainer_sources, "pp": trainer_pp},
        **sync_plan.summary(),
    }
    for source in summary["sources"]:
        source["stage"] = source["rank"] % trainer_pp
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        _print_tables(summary, sync_plan)


def _simulate(
    model_config: str | None, preset: str | None, options: SimulateOptions, as_json: bool
) -> None:
    try:
        name = _config_name(model_config, preset)
        config = _read_config(name)
        run_simulation(config, options, label=name, as_json=as_json)
    except _BadOption as exc:
        _exit_with(f"error: {exc}", _USAGE_ERROR)
    except SimulateOptionError as exc:
        _exit_with(f"error: {exc.option}: {exc}", _USAGE_ERROR)
    except PlotUnavailableError as exc:
        _exit_with(f"error: {exc}", _USAGE_ERROR)


def _config_name(model_config: str | None, preset: str | None) -> str:
    if preset is not None:
        if model_config is not None:
            raise _BadOption("--preset", "give --preset or --model-config, not both")
        if preset not in PRESETS:
            raise _BadOption(
                "--preset", f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}"
            )
        return preset
    if model_config is None:
        raise _BadOption(
            "--model-config", f"give a config (--model-config) or a --preset ({', '.join(PRESETS)})"
        )
    return model_config


def _exit_with(message: str, code: int) -> NoReturn:
    # One line on stderr: shells and CI logs show it whole, with no traceback.
    typer.echo(" ".join(message.split()), err=True)
    raise typer.Exit(code)


def _read_config(model_config: str) -> dict[str, Any]:
    path = Path(model_config)
    if not path.exists():
        bundled = (
            resources.files("weightsync") / "configs" / f"{model_config.removesuffix('.json')}.json"
        )
        if bundled.is_file():
            return json.loads(bundled.read_text())
        raise _BadOption(
            "--model-config",
            f"{model_config} does not exist; pass a config.json, a checkpoint folder or a "
            f"bundled config ({', '.join(_bundled_names())})",
        )
    try:
        return load_config_dict(path)
    except ValueError as exc:
        raise _BadOption("--model-config", f"{exc}") from exc


def _bundled_names() -> list[str]:
    folder = resources.files("weightsync") / "configs"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def _check_options(
    config: dict[str, Any],
    tp: int,
    ep: int,
    replicas: int,
    sources: int,
    pp: int,
    dtype: str | None,
    *,
    attn_tp: int,
) -> str | None:
    """Reject values that cannot work, naming the option; returns the canonical dtype name.
    `attn_tp` is the attention-TP size (`tp` without attention DP), which splits the heads."""
    for option, value in (
        ("--rollout-tp", tp),
        ("--rollout-ep", ep),
        ("--replicas", replicas),
        ("--trainer-sources", sources),
        ("--trainer-pp", pp),
    ):
        if value < 1:
            raise _BadOption(option, f"must be at least 1, got {value}")
    if tp % ep:
        raise _BadOption("--rollout-ep", f"{ep} must divide --rollout-tp {tp}")
    if sources % pp:
        raise _BadOption(
            "--trainer-sources",
            f"{sources} is not divisible by --trainer-pp {pp}; use a multiple of {pp} "
            "(every pipeline stage has the same number of data-parallel copies)",
        )
    try:
        dims = normalize_hf_config(config)
    except ValueError as exc:
        raise _BadOption("--model-config", f"{exc}") from exc
    heads = dims["num_attention_heads"]
    if heads % attn_tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        what = (
            f"{tp}"
            if attn_tp == tp
            else f"{attn_tp} attention-TP ranks (--rollout-tp / --rollout-dp-attention)"
        )
        raise _BadOption(
            "--rollout-tp",
            f"{what} does not divide the model's num_attention_heads={heads}; use one of "
            f"{', '.join(map(str, divisors))}",
        )
    layers = dims["num_hidden_layers"]
    if pp > layers:
        raise _BadOption(
            "--trainer-pp", f"{pp} stages exceed the model's {layers} layers; use at most {layers}"
        )
    if dtype is None:
        return None
    try:
        name = dtype_name(torch_dtype(dtype))
    except ValueError:
        name = None
    if name is None or not torch_dtype(name).is_floating_point:
        raise _BadOption(
            "--dtype", f"unknown dtype {dtype!r}; use bf16, fp16, fp32 or a full name (bfloat16)"
        )
    return name


def _compact_targets(targets: list[dict[str, Any]]) -> str:
    # "replica0:0-3, replica1:0-3" rather than one entry per rank.
    ranks: dict[str, list[int]] = {}
    for target in targets:
        ranks.setdefault(target["replica"], []).append(target["rank"])
    parts = [f"{replica}:{int_ranges(values, sep=',')}" for replica, values in ranks.items()]
    return ", ".join(parts) or "-"


def _human_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _layout_cells(parallelism: dict[str, Any]) -> tuple[str, ...]:
    """How one rank's layout reads in the layouts table: attention, MoE, dense MLP, lm_head."""
    tp, attn_tp, attn_dp = (
        parallelism["tp_size"],
        parallelism["attn_tp_size"],
        parallelism["attn_dp_size"],
    )
    attention = f"tp {attn_tp}" + (f" x dp {attn_dp}" if attn_dp > 1 else "")
    moe = f"ep {parallelism['ep_size']} x tp {parallelism['moe_tp_size']}"
    fused = parallelism["num_fused_shared_experts"]
    shared = f"fused ({fused} slot{'s' if fused > 1 else ''})" if fused else "apart"
    dense = parallelism["moe_dense_tp_size"]
    dense_cell = "replicated" if dense == 1 else f"tp {tp}"
    lm_head = f"attn tp {attn_tp}" if parallelism["enable_dp_lm_head"] else f"tp {tp}"
    return attention, moe, shared, dense_cell, lm_head


def _layouts_table(summary: dict[str, Any]) -> Table:
    """One row per distinct rollout layout: which ranks hold it and how it splits."""
    table = Table(title="Rollout layouts")
    columns = ("layout", "ranks", "attention", "moe", "shared experts", "dense mlp", "lm_head")
    for column in (*columns, "params", "bytes"):
        table.add_column(column, justify="right" if column in ("params", "bytes") else "left")
    seen: dict[int, list[dict[str, Any]]] = {}
    for target in summary["targets"]:
        seen.setdefault(target["layout_id"], []).append(target)
    for layout_id, members in sorted(seen.items()):
        first = members[0]
        table.add_row(
            str(layout_id),
            _compact_targets(members),
            *_layout_cells(first["parallelism"]),
            str(first["num_params"]),
            _human_bytes(first["bytes"]),
        )
    return table


def _print_tables(summary: dict[str, Any], sync_plan: SyncPlan) -> None:
    console = Console()
    console.print(_layouts_table(summary))
    targets = Table(title="Rollout target ranks")
    for column in ("replica", "rank", "session", "layout", "params", "bytes"):
        targets.add_column(column, justify="right" if column in ("params", "bytes") else "left")
    for target in summary["targets"]:
        targets.add_row(
            target["replica"],
            str(target["rank"]),
            target["session_id"],
            str(target["layout_id"]),
            str(target["num_params"]),
            _human_bytes(target["bytes"]),
        )
    sources = Table(title="Trainer sources")
    for column in ("rank", "stage", "tensors", "items", "staged", "written", "targets"):
        sources.add_column(column, justify="left" if column == "targets" else "right")
    for source in summary["sources"]:
        sources.add_row(
            str(source["rank"]),
            str(source["stage"]),
            str(source["num_tensors"]),
            str(source["num_items"]),
            _human_bytes(source["bytes_staged"]),
            _human_bytes(source["bytes"]),
            _compact_targets(source["targets"]),
        )
    console.print(targets)
    console.print(sources)
    console.print(
        f"dtype {summary['dtype']}, {summary['num_layout_groups']} distinct layout(s), "
        f"{summary['num_copy_items']} copy items, ~{summary['num_write_regions']} writes"
    )
    console.print(f"written in total: {_human_bytes(sync_plan.num_bytes_written)}")
    if summary["num_engine_owned"]:
        kinds = sorted(
            {kind for owned in sync_plan.engine_owned.values() for kind in owned.values()}
        )
        console.print(
            f"engine-owned, left alone: {summary['num_engine_owned']} parameters "
            f"({', '.join(kinds)}) on {len(sync_plan.engine_owned)} rank(s)"
        )
    console.print(f"imbalance (max / mean bytes written per source): {summary['imbalance']:.3f}")


def register(app: typer.Typer) -> None:
    """Add the `plan` command to `app`."""
    app.command("plan")(plan)
