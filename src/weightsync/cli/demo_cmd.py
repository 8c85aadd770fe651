"""`weightsync demo`: the whole system on one machine, end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
import os
import queue
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from weightsync.checkpoint import load_config_dict
from weightsync.cli.demo_trainer import (
    TRAINER_KINDS,
    TrainerArgs,
    quiet_transformers,
    run_trainer_rank,
)
from weightsync.cli.logs import configure_logging
from weightsync.layout import ParallelismConfig, rank_layout
from weightsync.layout.dtypes import ROLLOUT_DTYPE_CHOICES, canonical_dtype_name
from weightsync.layout.families import family_for
from weightsync.server.lifetime import ParentGoneError, exit_with_parent
from weightsync.testing.launcher import ServedReplica, start_replicas
from weightsync.testing.presets import (
    DEMO_PRESETS,
    preset_config,
    write_fp8_checkpoint,
    write_random_checkpoint,
)

_PROMPTS = ((1, 17, 42, 7), (5, 99, 3, 250, 11, 8), (600, 2, 2, 31))
# DeepSeek-V3's and Kimi-K2's FP8 block.
_FP8_BLOCK = 128
# The megatron-core constraints.txt pins; its metadata asks for Python >= 3.12 while its wheel
# runs on 3.11, hence --ignore-requires-python.
_MEGATRON_CORE = "megatron-core==0.19.2"
# AdamW's learning rate: large enough that a few steps of random tokens move the greedy
# tokens; with --delta an RL one, at which most updates vanish in the 16-bit rollout weights.
_LR = 2e-3
_DELTA_LR = 1e-6
_MIB = 1 << 20


def demo(
    replicas: Annotated[int, typer.Option(help="Rollout replicas to start.")] = 2,
    rollout_tp: Annotated[int, typer.Option(help="Tensor-parallel size of each replica.")] = 2,
    rollout_ep: Annotated[int, typer.Option(help="Expert-parallel size (MoE models).")] = 1,
    rollout_dp_attention: Annotated[
        int,
        typer.Option(
            help="Attention-DP groups inside each replica (DeepSeek-V3 family; SGLang's "
            "--enable-dp-attention --dp-size N): attention split per group, the MoE over all "
            "ranks; divides --rollout-tp."
        ),
    ] = 1,
    rollout_fused_shared_experts: Annotated[
        bool,
        typer.Option(
            help="Replicas hold the shared expert as the experts' last slot (DeepSeek-V3 "
            "family; SGLang's --enforce-shared-experts-fusion)."
        ),
    ] = False,
    trainer_ranks: Annotated[int, typer.Option(help="Trainer processes (sources).")] = 2,
    trainer_pp: Annotated[int, typer.Option(help="Pipeline stages the trainer exports.")] = 1,
    trainer: Annotated[
        str, typer.Option(help=f"Trainer: {', '.join(TRAINER_KINDS)} (see the README).")
    ] = "hf",
    trainer_tp: Annotated[
        int, typer.Option(help="Tensor-parallel size of the Megatron trainer.")
    ] = 1,
    trainer_ep: Annotated[
        int, typer.Option(help="Expert-parallel size of the Megatron trainer (MoE).")
    ] = 1,
    model: Annotated[str, typer.Option(help=f"Model preset: {', '.join(DEMO_PRESETS)}.")] = "tiny",
    steps: Annotated[int, typer.Option(help="Optimizer steps (one sync after each).")] = 3,
    dtype: Annotated[str, typer.Option(help="Rollout dtype: bf16, fp16 or fp32.")] = "bf16",
    rollout_fp8: Annotated[
        bool,
        typer.Option(
            help="Serve a block-FP8 checkpoint (DeepSeek-V3 family): the trainer learns it from "
            "the replicas and quantises what it syncs."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    workdir: Annotated[
        Path | None, typer.Option(help="Where to put the checkpoint and logs (kept).")
    ] = None,
    bucket_mb: Annotated[int, typer.Option(help="Sender bucket size in MiB.")] = 64,
    delta: Annotated[
        bool,
        typer.Option(
            "--delta",
            help="Sync deltas after the first (full) sync: the replicas get a delta region of "
            "1/8 of a rank's parameter bytes and the trainer writes only the elements that "
            "changed.",
        ),
    ] = False,
    lr: Annotated[
        float | None,
        typer.Option(
            help=f"AdamW's learning rate; default {_DELTA_LR:g} with --delta (an RL one), "
            f"{_LR:g} without."
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            help="Show every trainer rank's weightsync and Mooncake log lines (the replicas' "
            "are in their logs under --workdir).",
        ),
    ] = False,
) -> None:
    """Train a small model and sync it into live rollout replicas after every step.

    Writes a random-init HF checkpoint, starts the replicas with `weightsync serve` on
    loopback, snapshots and corrupts their weights, runs a torch.distributed (gloo) trainer
    that takes real optimizer steps, and syncs after each step (plus once before the first).
    The trainer is transformers data parallel (``hf``), FSDP2 (``fsdp``: every rank writes
    its shards) or Megatron-core (``megatron``: every rank writes the TP / PP / EP slices it
    holds; needs megatron-core: ``./scripts/setup --megatron`` in a checkout). With
    ``--delta`` every sync after the first writes only the elements that changed (see "Delta
    syncs" in docs/concepts.md), each replica checks every changed parameter whole, and the
    trainer takes RL-sized steps (``--lr``).
    Exits non-zero if the first sync is not bit-exact, a delta sync is not verified by every
    replica, or a replica's greedy generation ever differs from the trainer model's. Killed,
    even with SIGKILL, it leaves no process behind: the replicas and trainer ranks it starts
    stop when it dies.
    """
    _check_args(replicas, rollout_tp, rollout_ep, trainer_ranks, trainer_pp, model, steps, dtype)
    _check_deepseek_layout(rollout_dp_attention, rollout_fused_shared_experts, rollout_tp, model)
    _check_trainer(trainer, trainer_ranks, trainer_pp, trainer_tp, trainer_ep, model, rollout_fp8)
    _check_delta(delta, lr, model, dtype)
    if rollout_fp8 and not family_for(preset_config(model)["model_type"]).deepseek_moe:
        raise typer.BadParameter(
            f"block FP8 is laid out for the DeepSeek-V3 family (e.g. tiny-deepseek), not {model}",
            param_hint="--rollout-fp8",
        )
    configure_logging(verbose=verbose)
    quiet_transformers()
    console = Console(stderr=True)
    own_workdir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="weightsync-demo-")) if own_workdir else workdir
    root.mkdir(parents=True, exist_ok=True)
    started: list[ServedReplica] = []
    trainers: list[multiprocessing.Process] = []
    result: dict[str, Any] = {
        "ok": False,
        "replicas": replicas,
        "rollout_tp": rollout_tp,
        "rollout_dp_attention": rollout_dp_attention,
        "rollout_fused_shared_experts": rollout_fused_shared_experts,
        "trainer_ranks": trainer_ranks,
        "trainer": trainer,
        "delta": delta,
        "lr": lr if lr is not None else (_DELTA_LR if delta else _LR),
        "syncs": [],
        "bit_exact": False,
        "generation_match": False,
    }
    failure: str | None = None
    previous_handlers = _interrupt_on_signals()
    try:
        with _progress(console, quiet=False) as progress:
            task = progress.add_task("writing checkpoint", total=steps + 3)
            config = preset_config(model)
            if trainer == "megatron" and config["model_type"].endswith("moe"):
                # The Megatron trainer builds every layer as an MoE layer.
                config["mlp_only_layers"] = []
            checkpoint = write_random_checkpoint(root / "checkpoint", config, seed=0)
            served = checkpoint
            if rollout_fp8:
                served = write_fp8_checkpoint(root / "checkpoint-fp8", checkpoint, block=_FP8_BLOCK)
            progress.update(task, advance=1, description=f"starting {replicas} replica(s)")
            api_key = secrets.token_hex(16)
            region_mb = 0
            if delta:
                region_mb = _delta_region_mb(
                    load_config_dict(served),
                    tp=rollout_tp,
                    ep=rollout_ep,
                    dp_attention=rollout_dp_attention,
                    fused_shared_experts=rollout_fused_shared_experts,
                    dtype=dtype,
                )
                result["delta_region_mb"] = region_mb
            started = start_replicas(
                served,
                num_replicas=replicas,
                tp=rollout_tp,
                ep=rollout_ep,
                dtype=dtype,
                api_key=api_key,
                log_dir=root / "logs",
                delta_region_mb=region_mb,
                extra_args=_layout_args(rollout_dp_attention, rollout_fused_shared_experts),
            )
            progress.update(task, advance=1, description="trainer: first sync (bit-exact check)")
            args = TrainerArgs(
                checkpoint=str(checkpoint),
                replica_urls=tuple(r.url for r in started),
                api_key=api_key,
                world_size=trainer_ranks,
                pp_size=trainer_pp,
                steps=steps,
                rollout_dtype=canonical_dtype_name(dtype),
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                bucket_bytes=bucket_mb << 20,
                prompts=_PROMPTS,
                max_new_tokens=8,
                transfer_timeout_s=30.0,
                lr=result["lr"],
                delta=delta,
                trainer=trainer,
                tp_size=trainer_tp,
                ep_size=trainer_ep,
                fp8_block=_FP8_BLOCK if rollout_fp8 else 0,
                verbose=verbose,
            )
            ctx = multiprocessing.get_context("spawn")
            events = ctx.Queue()
            for rank in range(trainer_ranks):
                proc = ctx.Process(
                    target=_trainer_rank, args=(os.getpid(), rank, args, events), daemon=True
                )
                proc.start()
                trainers.append(proc)
            failure = _collect(events, trainers, result, progress, task, console, as_json)
    except KeyboardInterrupt:
        failure = "interrupted"
    except (RuntimeError, OSError, ValueError) as exc:
        failure = str(exc)
    finally:
        for proc in trainers:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
        for replica in started:
            replica.stop()
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        if own_workdir and failure is None:
            shutil.rmtree(root, ignore_errors=True)

    syncs = result["syncs"]
    result["bit_exact"] = (
        bool(syncs)
        and syncs[0]["bit_exact"] is True
        and all(s["bit_exact"] is True for s in syncs if s["mode"] == "delta")
    )
    result["generation_match"] = bool(syncs) and all(s["generation_match"] for s in syncs)
    result["ok"] = (
        failure is None
        and len(syncs) == steps + 1
        and result["bit_exact"]
        and result["generation_match"]
    )
    if as_json:
        print(json.dumps(result))
    else:
        _print_summary(console, result, failure, root)
    if not result["ok"]:
        raise typer.Exit(code=1)


def _trainer_rank(demo_pid: int, rank: int, args: TrainerArgs, events: Any) -> None:
    """One trainer rank (a spawned process) that dies with the demo, however it ends."""
    try:
        exit_with_parent(demo_pid, sig=signal.SIGKILL)
    except ParentGoneError:
        return
    run_trainer_rank(rank, args, events)


PEERS_GRACE_S = 20.0
"""How long the demo waits for the other trainer ranks to end once one failed."""


def _collect(
    events: Any,
    trainers: list[multiprocessing.Process],
    result: dict[str, Any],
    progress: Progress,
    task: Any,
    console: Console,
    as_json: bool,
) -> str | None:
    """Consume trainer events until every rank exited, or `PEERS_GRACE_S` after one failed
    (the others may wait in a collective for it for good; the caller ends them); return a
    failure message or None."""
    exited: set[int] = set()
    failure: str | None = None
    deadline = math.inf
    while len(exited) < len(trainers):
        if time.monotonic() > deadline:
            break
        try:
            event = events.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(trainers) if not p.is_alive() and i not in exited]
            if dead and events.empty():
                failure = failure or f"trainer rank(s) {dead} died without reporting"
                break
            continue
        if event["kind"] == "sync":
            report = event["report"]
            entry = _sync_entry(report, event)
            result["syncs"].append(entry)
            if not as_json:
                console.print(_sync_table(entry, event["step"], delta=result["delta"]))
            if not event["generation_match"]:
                failure = failure or (
                    f"generation mismatch after sync {report['version']}: trainer "
                    f"{event['expected']}, replicas {event['actual']}"
                )
            progress.update(task, advance=1, description=f"synced version {report['version']}")
        elif event["kind"] == "error":
            failure = failure or f"trainer rank {event['rank']}: {event['message']}"
            deadline = min(deadline, time.monotonic() + PEERS_GRACE_S)
            console.print(f"trainer rank {event['rank']} failed:\n{event['trace']}", markup=False)
        elif event["kind"] == "exit":
            exited.add(event["rank"])
    return failure


def _sync_entry(report: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """One sync's line of the demo's result, from the trainer's event and its report.

    ``mode`` is ``"full"`` or ``"delta"`` when every replica was written the same way, else
    ``"mixed"`` (``writes`` has each replica's); ``bytes`` are the bytes put on the wire,
    ``full_bytes`` those a full sync writes; ``density`` is the largest share of elements a
    delta changed in a replica (None without one). ``bit_exact`` is the built-in check's
    result for the first sync and, for a sync that wrote every replica a delta, whether every
    replica verified it (each checks that every changed parameter, whole, went from its
    proven base to base + change); None otherwise.
    """
    writes = report["writes"]
    modes = {w["mode"] for w in writes.values()} or {"full"}
    mode = modes.pop() if len(modes) == 1 else "mixed"
    densities = [w["density"] for w in writes.values() if w["mode"] == "delta"]
    bit_exact = report["bit_exact"]
    if bit_exact is None and mode == "delta":
        bit_exact = set(writes) <= set(report["verified"])
    return {
        "version": report["version"],
        "mode": mode,
        "bytes": report["bytes"],
        "full_bytes": sum(w["full_bytes"] for w in writes.values()) if writes else report["bytes"],
        "density": max(densities) if densities else None,
        "writes": writes,
        "seconds": report["seconds"],
        "gbps": report["gbps"],
        "num_writes": report["num_writes"],
        "phases": report["phases"],
        "bit_exact": bit_exact,
        "generation_match": event["generation_match"],
        "loss": event["loss"],
    }


def _sync_table(entry: dict[str, Any], step: int, *, delta: bool) -> Table:
    phases = entry["phases"]
    table = Table(
        title=f"sync {entry['version']} (after step {step}); phases in seconds",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
    )
    columns = ("MiB", "s", "GB/s", "writes", "pause", "meta", "push", "final", "resume",
               "exact", "gen")  # fmt: skip
    if delta:
        columns = ("mode", "changed", *columns)
    for column in columns:
        # "delta" and "full" in columns of one width keep the syncs' tables aligned.
        table.add_column(column, justify="right", min_width=5 if column == "mode" else None)
    bit_exact = entry["bit_exact"]
    density = entry["density"]
    table.add_row(
        *((entry["mode"], "-" if density is None else f"{density:.2%}") if delta else ()),
        f"{entry['bytes'] / 2**20:.2f}",
        f"{entry['seconds']:.3f}",
        f"{entry['gbps']:.3f}",
        str(entry["num_writes"]),
        *(f"{phases[p]:.3f}" for p in ("pause", "metadata", "push", "finalize", "resume")),
        "-" if bit_exact is None else ("yes" if bit_exact else "NO"),
        "equal" if entry["generation_match"] else "DIFF",
    )
    return table


def _print_summary(
    console: Console, result: dict[str, Any], failure: str | None, root: Path
) -> None:
    if result["ok"]:
        console.print(
            f"[green]ok[/green]: {len(result['syncs'])} syncs into {result['replicas']} "
            f"replica(s) at tp={result['rollout_tp']}{_layout_note(result)}, first sync "
            "bit-exact, generation equal after every sync"
        )
        deltas = [s for s in result["syncs"] if s["mode"] == "delta"]
        if deltas:
            sent = sum(s["bytes"] for s in deltas) / 2**20
            full = sum(s["full_bytes"] for s in deltas) / 2**20
            console.print(
                f"deltas: {len(deltas)} syncs wrote {sent:.2f} MiB of {full:.2f} MiB full "
                f"(lr {result['lr']:g}), each verified by every replica"
            )
    else:
        console.print(f"demo failed: {failure or 'checks did not pass'}", style="red", markup=False)
        console.print(f"checkpoint and logs kept in {root}")


def _layout_note(result: dict[str, Any]) -> str:
    notes = []
    if result["rollout_dp_attention"] > 1:
        notes.append(f" with {result['rollout_dp_attention']} attention-DP groups")
    if result["rollout_fused_shared_experts"]:
        notes.append(" with fused shared experts")
    return ",".join(notes)


def _progress(console: Console, *, quiet: bool) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
    )


def _check_args(
    replicas: int,
    rollout_tp: int,
    rollout_ep: int,
    trainer_ranks: int,
    trainer_pp: int,
    model: str,
    steps: int,
    dtype: str,
) -> None:
    def bad(option: str, message: str) -> None:
        raise typer.BadParameter(message, param_hint=option)

    if replicas < 1:
        bad("--replicas", "must be at least 1")
    if rollout_tp < 1:
        bad("--rollout-tp", "must be at least 1")
    if rollout_ep < 1 or rollout_tp % rollout_ep:
        bad("--rollout-ep", f"must divide --rollout-tp ({rollout_tp})")
    if trainer_ranks < 1:
        bad("--trainer-ranks", "must be at least 1")
    if trainer_pp < 1 or trainer_ranks % trainer_pp:
        bad("--trainer-pp", f"must divide --trainer-ranks ({trainer_ranks})")
    if model not in DEMO_PRESETS:
        bad("--model", f"choose one of {', '.join(DEMO_PRESETS)}")
    if steps < 0:
        bad("--steps", "must not be negative")
    if dtype not in ROLLOUT_DTYPE_CHOICES:
        bad("--dtype", f"choose one of {', '.join(ROLLOUT_DTYPE_CHOICES)}")
    if rollout_ep > 1 and not family_for(preset_config(model)["model_type"]).moe:
        bad("--rollout-ep", f"expert parallelism needs an MoE model (e.g. tiny-moe), not {model}")


def _check_trainer(
    trainer: str,
    trainer_ranks: int,
    trainer_pp: int,
    tp: int,
    ep: int,
    model: str,
    rollout_fp8: bool,
) -> None:
    def bad(option: str, message: str) -> None:
        raise typer.BadParameter(message, param_hint=option)

    if trainer not in TRAINER_KINDS:
        bad("--trainer", f"choose one of {', '.join(TRAINER_KINDS)}")
    if tp < 1 or ep < 1:
        bad("--trainer-tp" if tp < 1 else "--trainer-ep", "must be at least 1")
    if trainer != "megatron" and (tp > 1 or ep > 1):
        bad("--trainer-tp" if tp > 1 else "--trainer-ep", "only the megatron trainer has it")
    if trainer != "hf" and rollout_fp8:
        bad("--rollout-fp8", "an FP8 rollout is synced from the hf trainer")
    if trainer == "fsdp" and trainer_pp > 1:
        bad("--trainer-pp", "the fsdp trainer shards every layer over all ranks; use 1")
    if trainer == "megatron":
        if not _has_megatron_core():
            bad(
                "--trainer",
                "the megatron trainer needs megatron-core, which is not installed here; "
                "install it with `./scripts/setup --megatron` in a weightsync checkout, or "
                f"`{sys.executable} -m pip install --ignore-requires-python {_MEGATRON_CORE}`",
            )
        if trainer_ranks % (tp * trainer_pp):
            bad("--trainer-ranks", f"must be a multiple of tp x pp ({tp} x {trainer_pp})")
        model_type = preset_config(model)["model_type"]
        if model_type not in ("qwen3", "qwen3_moe"):
            bad("--model", f"the megatron trainer builds Qwen3 and Qwen3-MoE models, not {model}")
        moe = model_type == "qwen3_moe"
        if moe and tp > 1:
            bad("--trainer-tp", "the megatron trainer trains MoE models at tp 1 (use --trainer-ep)")
        if ep > 1 and (not moe or trainer_ranks % ep):
            bad("--trainer-ep", "expert parallelism needs an MoE model and ep dividing the ranks")


def _check_deepseek_layout(dp_attention: int, fused: bool, rollout_tp: int, model: str) -> None:
    def bad(option: str, message: str) -> None:
        raise typer.BadParameter(message, param_hint=option)

    deepseek = family_for(preset_config(model)["model_type"]).deepseek_moe
    if dp_attention < 1 or rollout_tp % dp_attention:
        bad("--rollout-dp-attention", f"must divide --rollout-tp ({rollout_tp})")
    if dp_attention > 1 and not deepseek:
        bad(
            "--rollout-dp-attention",
            "DP attention is laid out for the DeepSeek-V3 family (e.g. tiny-deepseek), "
            f"not {model}",
        )
    if fused and not deepseek:
        bad(
            "--rollout-fused-shared-experts",
            f"shared experts are DeepSeek-V3's (e.g. tiny-deepseek), not {model}'s",
        )


def _layout_args(dp_attention: int, fused: bool) -> list[str]:
    """The `weightsync serve` options of the replicas' DeepSeek-V3 layout (SGLang's names)."""
    args = ["--enable-dp-attention", "--dp-size", str(dp_attention)] if dp_attention > 1 else []
    return args + (["--enforce-shared-experts-fusion"] if fused else [])


def _delta_region_mb(
    hf_config: dict[str, Any],
    *,
    tp: int,
    ep: int,
    dtype: str,
    dp_attention: int = 1,
    fused_shared_experts: bool = False,
) -> int:
    """MiB of the delta region each replica rank registers: 1/8 of the largest rank's
    parameter bytes in the rollout dtype, rounded up, at least 1.

    A changed 16-bit element costs twice a full write's bytes, so 1/8 holds densities up to
    about 6 % (docs/concepts.md, "Delta syncs"), well above what an RL step changes.
    """
    rank_bytes = max(
        sum(
            param.num_bytes
            for param in rank_layout(
                hf_config,
                ParallelismConfig(
                    tp_size=tp,
                    tp_rank=rank,
                    ep_size=ep,
                    attn_dp_size=dp_attention,
                    num_fused_shared_experts=(
                        hf_config.get("n_shared_experts", 0) if fused_shared_experts else 0
                    ),
                ),
                canonical_dtype_name(dtype),
            ).values()
        )
        for rank in range(tp)
    )
    return max(1, -(-rank_bytes // (8 * _MIB)))


def _check_delta(delta: bool, lr: float | None, model: str, dtype: str) -> None:
    def bad(option: str, message: str) -> None:
        raise typer.BadParameter(message, param_hint=option)

    if lr is not None and not lr > 0:
        bad("--lr", "must be positive")
    if not delta:
        return
    if dtype != "bf16":
        # Measured at lr 1e-6: fp16's three more mantissa bits let 12-20 % of its elements
        # change per step, and fp32 rounds nothing away (nearly all change).
        bad(
            "--delta",
            f"{dtype} rollouts change too many elements per step for a delta region of 1/8 "
            "of a rank's bytes; use --dtype bf16",
        )


def _has_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` package at all
        return False


def _interrupt_on_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt, so the demo's cleanup runs.

    A shell starts background jobs with SIGINT ignored, and SIGTERM would end the process
    without cleanup: either way the replicas, which run in sessions of their own, would be
    left behind. Returns the previous handlers.
    """

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, interrupt)
    return previous


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def register(app: typer.Typer) -> None:
    """Add the `demo` command to `app`."""
    app.command("demo")(demo)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(typer.run(demo))
