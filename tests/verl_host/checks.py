"""Checks of the verl backend that need verl but no cluster, run in the verl venv by
tests/test_verl.py: ``python checks.py TMP_DIR``. Prints, last, one JSON line mapping each
check to ``"ok"`` or what went wrong."""

from __future__ import annotations

import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


@check
def import_is_cheap() -> None:
    # What verl has loaded where it imports a plugin (it builds the engine right after).
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    CheckpointEngineRegistry.get("naive")
    before = set(sys.modules)
    t0 = time.perf_counter()
    import weightsync.integrations.verl  # noqa: F401

    seconds = time.perf_counter() - t0
    loaded = set(sys.modules) - before
    heavy = sorted(
        m
        for m in loaded
        if m.split(".")[0] in ("mooncake", "aiohttp", "fastapi")
        or m.startswith(("weightsync.plan", "weightsync.sender", "weightsync.manager"))
        or m.startswith(("weightsync.transport", "weightsync.layout", "weightsync.export"))
    )
    if heavy:
        raise AssertionError(f"importing the backend loaded {heavy}")
    if seconds > 2.0:
        raise AssertionError(f"importing the backend took {seconds:.2f} s")


@check
def delta_policies_are_the_managers() -> None:
    # The options keep their own copy so that importing them stays cheap (above).
    from weightsync.integrations.verl.options import DELTA_WHEN as OPTIONS
    from weightsync.manager.config import DELTA_WHEN

    if OPTIONS != DELTA_WHEN:
        raise AssertionError(f"verl's delta_when values {OPTIONS} differ from {DELTA_WHEN}")


@check
def registered_under_both_names() -> None:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    from weightsync.integrations.verl import WeightsyncCheckpointEngine

    for name in ("weightsync", "p2p"):
        if CheckpointEngineRegistry.get(name) is not WeightsyncCheckpointEngine:
            raise AssertionError(f"{name} is {CheckpointEngineRegistry.get(name)}")
    if not issubclass(WeightsyncCheckpointEngine, CheckpointEngine):
        raise AssertionError("not a verl CheckpointEngine")
    actor = CheckpointEngineRegistry.new(
        "p2p",
        is_master=True,
        bucket_size=8 << 20,
        model_path="/m",
        update_weights_bucket_megabytes=3,
    )
    rollout = CheckpointEngineRegistry.new("weightsync", bucket_size=8 << 20, model_path="/m")
    if not actor.is_actor or rollout.is_actor or actor.bucket_bytes != 3 << 20:
        raise AssertionError("sides or bucket size wrong")
    if rollout.bucket_bytes != 8 << 20:
        raise AssertionError("verl's bucket size is not the default")


@check
def bad_engine_kwargs_are_refused_by_name() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    cases = [
        ({}, "model_path is required"),
        ({"model_path": "/m", "bucket_mb": 1}, "unknown key(s) ['bucket_mb']"),
        (
            {"model_path": "/m", "update_weights_bucket_megabytes": 0},
            "update_weights_bucket_megabytes",
        ),
        (
            {"model_path": "/m", "update_weights_bucket_megabytes": "64"},
            "update_weights_bucket_megabytes",
        ),
        ({"model_path": "/m", "check_weight_update_equal": "yes"}, "check_weight_update_equal"),
        (
            {"model_path": "/m", "check_weight_update_allow_quant_error": 1},
            "check_weight_update_allow_quant_error",
        ),
        ({"model_path": "/m", "transfer_num_workers": 0}, "transfer_num_workers"),
        ({"model_path": "/m", "transfer_timeout_s": -1}, "transfer_timeout_s"),
        ({"model_path": "/m", "transfer_timeout_s": float("inf")}, "transfer_timeout_s"),
        ({"model_path": "/m", "transport": "nvlink"}, "transport='nvlink'"),
        ({"model_path": "/m", "api_key": ""}, "api_key"),
        ({"model_path": "/m", "server_actor_name": "srv_{replica}"}, "server_actor_name"),
        ({"model_path": "/m", "lifecycle_timeout_s": 0}, "lifecycle_timeout_s"),
        ({"model_path": "/m", "delta": "true"}, "delta must be true or false"),
        ({"model_path": "/m", "delta_when": "sometimes"}, "delta_when='sometimes'"),
    ]
    for kwargs, expected in cases:
        try:
            CheckpointEngineRegistry.new("weightsync", bucket_size=1 << 20, **kwargs)
        except ValueError as exc:
            if expected not in str(exc) or "engine_kwargs.weightsync" not in str(exc):
                raise AssertionError(f"{kwargs}: {exc}") from exc
        else:
            raise AssertionError(f"{kwargs} was accepted")
    from weightsync.integrations.verl import VerlOptions

    try:
        VerlOptions(model_path="/nonexistent").hf_config()
    except ValueError as exc:
        if "/nonexistent" not in str(exc):
            raise
    else:
        raise AssertionError("a missing config.json was accepted")


@check
def stock_verl_worker_names_give_the_replica() -> None:
    from weightsync.integrations.verl.replicas import replica_rank_of, url_of

    # As RolloutReplica.init_standalone / init_colocated and RayWorkerGroup name them.
    cases = {
        "rollout_standalone_3CheckpointEngineWorker_0:1": 3,
        "rollout_standalone_12_evalCheckpointEngineWorker_1:0": 12,
        "rollout_colocate_0CheckpointEngineWorker_0:0": 0,
        "rollout_reward_standalone_1CheckpointEngineWorker_0:0": None,
        "rollout_standalone_x": None,
        None: None,
    }
    for name, rank in cases.items():
        if replica_rank_of(name) != rank:
            raise AssertionError(f"{name!r}: {replica_rank_of(name)}, expected {rank}")
    if url_of("10.0.0.1:8000") != "http://10.0.0.1:8000" or url_of("http://h:1") != "http://h:1":
        raise AssertionError("url_of")


@check
def sglang_memory_saver_and_shared_bootstrap_port_are_refused() -> None:
    from verl.workers.config import RolloutConfig

    from weightsync.integrations.verl.hook import ManagerHook, port_collisions, refusal

    def replica(rank: int, sglang: dict, port: int | None = None, host: str = "10.0.0.1"):
        config = RolloutConfig(name="sglang", engine_kwargs={"sglang": sglang})
        return SimpleNamespace(
            replica_rank=rank,
            config=config,
            server_address=f"{host}:{8000 + rank}",
            engine_info_bootstrap_port=port,
            workers=[],
        )

    seed = {"remote_instance_weight_loader_start_seed_via_transfer_engine": True}
    from weightsync.integrations.verl.backend import verl_advice

    # Stock verl: SyncManager refuses the replica from its /server_info; the backend adds
    # the verl key to change.
    advice = verl_advice("enable_memory_saver=True: the memory saver frees ... weight memory")
    if advice is None or "engine_kwargs.sglang.enable_memory_saver=false" not in advice:
        raise AssertionError(f"stock verl advice: {advice}")
    if verl_advice("not reachable") is not None:
        raise AssertionError("advice for an unrelated failure")
    default = refusal(replica(0, {}))
    if default is None or "enable_memory_saver=false" not in default:
        raise AssertionError(f"verl's default memory saver: {default}")
    explicit = refusal(replica(0, {**seed, "enable_memory_saver": True}))
    if explicit is None or "memory saver" not in explicit:
        raise AssertionError(f"memory saver on: {explicit}")
    unseeded = refusal(replica(0, {"enable_memory_saver": False}))
    if unseeded is None or "start_seed_via_transfer_engine=true" not in unseeded:
        raise AssertionError(f"no seed: {unseeded}")
    if refusal(replica(0, seed)) is not None:  # the patch turns the saver off under the seed
        raise AssertionError("a seeded replica was refused")
    hook = ManagerHook(SimpleNamespace(actor_wg=None))
    try:
        hook.on_replicas_changed([replica(0, {})], added=[replica(0, {})], removed=[])
    except ValueError as exc:
        if "replica 0" not in str(exc) or "enable_memory_saver" not in str(exc):
            raise
    else:
        raise AssertionError("the hook accepted the memory saver")
    same = [replica(0, seed, 6789), replica(1, seed, 6789)]
    if not port_collisions(same) or port_collisions([same[0], replica(1, seed, 6789, "10.0.0.2")]):
        raise AssertionError("bootstrap port collisions misjudged")
    try:
        hook.on_replicas_changed(same, added=same, removed=[])
    except ValueError as exc:
        if "share engine-info bootstrap port 6789" not in str(exc):
            raise
    else:
        raise AssertionError("the hook accepted a shared bootstrap port")


@check
def patch_applies_once_to_verl_0_9_1_and_refuses_others(tmp: Path) -> None:
    import verl

    from weightsync.integrations.verl.patches import PATCH_FILE, apply_patch, is_patched

    installed = Path(verl.__file__).parent.parent
    touched = [
        line[len("+++ b/") :].strip()
        for line in PATCH_FILE.read_text().splitlines()
        if line.startswith("+++ b/")
    ]

    def copy_of_installed(root: Path) -> None:  # the files the patch touches
        for path in touched:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(installed / path, root / path)

    clean = tmp / "clean"
    copy_of_installed(clean)
    if is_patched(clean) or not apply_patch(clean, dry_run=True) or is_patched(clean):
        raise AssertionError("the dry run changed something, or found nothing to apply")
    if not apply_patch(clean) or not is_patched(clean) or apply_patch(clean):
        raise AssertionError("the patch did not apply exactly once")
    for path in touched:  # every patched file still compiles (SGLang, Megatron: not importable)
        compile((clean / path).read_text(), str(clean / path), "exec")
    other = tmp / "other"
    copy_of_installed(other)
    base = other / "verl" / "checkpoint_engine" / "base.py"
    base.write_text(base.read_text().replace("replicas_set = set(replicas)", "gone = 1"))
    try:
        apply_patch(other)
    except ValueError as exc:
        if "does not apply" not in str(exc):
            raise
    else:
        raise AssertionError("the patch applied to an edited verl")
    if is_patched(other) or "gone = 1" not in base.read_text():
        raise AssertionError("a refused patch changed files")


def main() -> int:
    tmp = Path(sys.argv[1])
    report = {}
    for name, fn in CHECKS.items():
        try:
            fn(tmp) if fn.__code__.co_argcount else fn()
            report[name] = "ok"
        except Exception:
            report[name] = traceback.format_exc(limit=3)[-1500:]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
