"""verl's real ``CheckpointEngineManager`` and workers drive weightsync into reference replicas.

Run in the verl venv (scripts/setup-verl) by tests/test_verl.py, on a Ray cluster bound to
127.0.0.1, against three running `weightsync serve` replicas::

    python scenario.py --ray-address 127.0.0.1:PORT --checkpoint DIR --out result.json \
        --replica URL,BOOTSTRAP_PORT (x3) [--patched]

Two actor ranks (verl's ``ActorRolloutRefWorker`` with the stand-in engine of standins.py)
and replicas 0, 1 (verl ``RolloutReplica`` objects, one ``CheckpointEngineWorker`` each):

1. update(1): the first sync after the checker's reset, bit-exact;
2. a training step, ``add_replicas([replica 2])``, update(2): replica 2 is served;
3. ``remove_replicas([replica 0])``, a step, update(3): replica 0 is no longer written;
4. (``--patched``) a step, then a sender that fails mid-push in update(4): every session
   ends, the replicas written to stay paused and serve nothing, the exception reaches the
   trainer; update(5) serves again.

After each update every replica written serves the trainer's greedy tokens and the weight
version ``global_steps``. Every check raises here; the result JSON carries what was seen
and the timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

LOOPBACK_ENV = {
    # ray.util.get_node_ip_address() in Ray workers falls back to the default route's
    # address unless this is off; verl takes every address from it.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
    "VERL_LOGGING_LEVEL": "WARN",
}
PROMPTS = ((1, 17, 42, 7), (600, 2, 31, 99, 5))
NEW_TOKENS = 5


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--replica", action="append", required=True)
    parser.add_argument("--patched", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    timings: dict[str, float] = {}
    result: dict[str, Any] = {"patched": args.patched, "timings": timings, "updates": {}}
    t_start = time.perf_counter()

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 3)
        return now

    import ray

    os.environ.update(LOOPBACK_ENV)
    t = time.perf_counter()
    ray.init(
        address=args.ray_address,
        runtime_env={
            "env_vars": {
                **LOOPBACK_ENV,
                "PYTHONPATH": os.environ["PYTHONPATH"],
                "VERL_TEST_CHECKPOINT": args.checkpoint,
            }
        },
        logging_level="WARNING",
        log_to_driver=True,
    )
    t = mark("ray_connect", t)

    import verl.checkpoint_engine.base as verl_base
    from omegaconf import OmegaConf
    from standins import ActorWorker, ReferenceReplica
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    from weightsync.control import RolloutClient
    from weightsync.testing.reference import served_tokens

    patched = hasattr(verl_base, "CheckpointEngineManagerHook")
    if patched != args.patched:
        raise SystemExit(f"verl at {verl_base.__file__}: patched={patched}, asked {args.patched}")
    result["verl_base"] = verl_base.__file__
    t = mark("driver_imports", t)

    replicas_in = [(u, int(p)) for u, p in (r.rsplit(",", 1) for r in args.replica)]
    checkpoint_engine = {
        "_target_": "verl.workers.config.CheckpointEngineConfig",
        "backend": "weightsync",
        "update_weights_bucket_megabytes": 1,
        "custom_backend_module": "weightsync.integrations.verl",
        "engine_kwargs": {
            "weightsync": {
                "model_path": args.checkpoint,
                "check_weight_update_equal": True,
                "transfer_num_workers": 1,
                "transfer_timeout_s": 10.0,
                "transport": "tcp",
                "server_actor_name": "reference_server_{replica_rank}_{node_rank}",
            },
            "nccl": {"unused": 1},
        },
    }
    ce_config = omega_conf_to_dataclass(OmegaConf.create(checkpoint_engine))
    rollout_config = RolloutConfig(
        name="weightsync_reference",
        tensor_model_parallel_size=1,
        data_parallel_size=1,
        pipeline_model_parallel_size=1,
        free_cache_engine=True,
        checkpoint_engine=ce_config,
    )
    actor_config = OmegaConf.create(
        {
            "actor": {"strategy": "fsdp", "profiler": {}},
            "rollout": {"name": "weightsync_reference", "checkpoint_engine": checkpoint_engine},
            "model": {},
        }
    )
    pool = RayResourcePool(
        process_on_nodes=[2], use_gpu=False, max_colocate_count=1, name_prefix="actor"
    )
    actor_wg = RayWorkerGroup(
        resource_pool=pool,
        ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(ActorWorker), config=actor_config, role="actor"
        ),
        name_prefix="actor",
        device_name="cpu",
    )

    def replica(rank: int) -> ReferenceReplica:
        url, bootstrap_port = replicas_in[rank]
        return ReferenceReplica(
            replica_rank=rank,
            config=rollout_config,
            model_config=None,
            gpus_per_node=8,
            url=url,
            bootstrap_port=bootstrap_port,
        )

    async def launch(replicas: list[ReferenceReplica]) -> None:
        await asyncio.gather(*(r.init_standalone() for r in replicas))

    first = [replica(0), replica(1)]
    # The actor ranks and the first replicas' workers start together.
    init_refs = actor_wg.execute_all_async("init_model")
    asyncio.run(launch(first))
    ray.get(init_refs)
    t = mark("workers_up", t)

    manager = CheckpointEngineManager(config=ce_config, actor_wg=actor_wg, replicas=list(first))
    t = mark("manager_created", t)

    def call(url: str, method: str, *a: Any, **kw: Any) -> Any:
        async def run() -> Any:
            async with RolloutClient(url, timeout_s=30.0) as client:
                return await getattr(client, method)(*a, **kw)

        return asyncio.run(run())

    def version(url: str) -> str | None:
        return call(url, "get_model_info")["weight_version"]

    def check_served(step: int, written: list[ReferenceReplica]) -> None:
        expected = actor_wg.greedy(PROMPTS, NEW_TOKENS)[0]
        urls = [r.url for r in written]
        served = asyncio.run(served_tokens(urls, PROMPTS, max_new_tokens=NEW_TOKENS))
        for r in written:
            if served[r.url] != expected:
                raise AssertionError(
                    f"update {step}: replica {r.replica_rank} serves {served[r.url]}, "
                    f"trainer {expected}"
                )
            if version(r.url) != str(step):
                raise AssertionError(
                    f"update {step}: replica {r.replica_rank} serves version {version(r.url)}"
                )
        result["updates"][str(step)]["tokens_equal"] = True

    def update(step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        metrics = manager.update_weights(global_steps=step)
        timings[f"update_{step}"] = round(time.perf_counter() - t0, 3)
        result["updates"][str(step)] = {"metrics": metrics}
        return metrics

    metrics = update(1)
    if metrics.get("weightsync/bit_exact") != 1.0:
        raise AssertionError(f"the first sync is not bit-exact: {metrics}")
    check_served(1, first)
    result["mode_patched_hook"] = metrics["weightsync/patched_hook"]
    if metrics["weightsync/patched_hook"] != float(args.patched):
        raise AssertionError(f"backend mode: {metrics}")

    t = time.perf_counter()
    added = replica(2)
    asyncio.run(launch([added]))
    t = mark("replica_2_up", t)
    actor_wg.train_step(2)
    manager.add_replicas([added])
    update(2)
    check_served(2, [*first, added])

    manager.remove_replicas([first[0]])
    actor_wg.train_step(3)
    update(3)
    live = [first[1], added]
    check_served(3, live)
    if version(first[0].url) != "2":
        raise AssertionError(f"removed replica 0 was written: version {version(first[0].url)}")
    result["removed_replica_version"] = version(first[0].url)

    exports = actor_wg.exports()
    result["exports"] = [
        {
            "rank": e["rank"],
            "pp_local": e["exports"][-1]["pp_local"],
            "num_tensors": len(e["exports"][-1]["names"]),
        }
        for e in exports
    ]
    result["backend_class"] = exports[0]["backend"]
    check_exports(exports, patched=args.patched)

    if args.patched:
        actor_wg.train_step(4)
        actor_wg.fail_writes_after(1)
        try:
            update(4)
        except Exception as exc:  # the trainer sees the failure
            if "injected sender failure" not in str(exc):
                raise
            result["failure"] = {"type": type(exc).__name__, "message": str(exc)[-20000:]}
        else:
            raise AssertionError("update 4 did not fail")
        # Every session ended; a replica holds either the whole new version (its writes all
        # landed and were verified, so verl resumed it) or its weights marked incomplete,
        # paused, still labelled 3: none serves half-written weights.
        expected = actor_wg.greedy(PROMPTS, NEW_TOKENS)[0]
        outcome = {}
        for r in live:
            info = call(r.url, "get_server_info")
            state, weights = info["state"], info["weightsync"]["weights"]
            if state["weight_update_session"] != "closed":
                raise AssertionError(
                    f"replica {r.replica_rank}: session left {state['weight_update_session']}"
                )
            if state["memory_released"]:
                raise AssertionError(f"replica {r.replica_rank}: KV cache not resumed: {state}")
            if version(r.url) == "4":
                if state["paused"] or not weights["complete"]:
                    raise AssertionError(
                        f"replica {r.replica_rank} at version 4: {state}, {weights}"
                    )
                served = asyncio.run(served_tokens([r.url], PROMPTS, max_new_tokens=NEW_TOKENS))
                if served[r.url] != expected:
                    raise AssertionError(f"replica {r.replica_rank} serves version 4 wrongly")
                outcome[r.replica_rank] = "updated"
            else:
                if version(r.url) != "3" or not state["paused"] or weights["complete"]:
                    raise AssertionError(
                        f"replica {r.replica_rank} after a failed push: {state}, {weights}"
                    )
                try:
                    call(r.url, "generate", list(PROMPTS[0]), max_new_tokens=2)
                except Exception as exc:
                    result["generate_after_failure"] = str(exc)[:200]
                else:
                    raise AssertionError(
                        f"replica {r.replica_rank} generated from half-written weights"
                    )
                outcome[r.replica_rank] = "paused, weights incomplete"
        if "paused, weights incomplete" not in outcome.values():
            raise AssertionError(f"the injected failure left no replica paused: {outcome}")
        result["after_failure"] = outcome
        actor_wg.fail_writes_after(None)
        update(5)
        check_served(5, live)

    timings["total"] = round(time.perf_counter() - t_start, 3)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    ray.shutdown()
    return 0


def check_exports(exports: list[dict[str, Any]], *, patched: bool) -> None:
    """Stock verl hands every rank the whole model; patched verl each rank its stage."""
    everything = set(exports[0]["stages"])
    seen: list[set[str]] = []
    for e in exports:
        last = e["exports"][-1]
        names = set(last["names"])
        if last["pp_local"] != patched:
            raise AssertionError(f"rank {e['rank']}: pp_local={last['pp_local']}")
        if patched:
            wrong = [n for n in names if e["stages"][n] != e["rank"]]
            if wrong or not names:
                raise AssertionError(
                    f"rank {e['rank']} exported other stages' tensors: {wrong[:3]}"
                )
        elif names != everything:
            raise AssertionError(f"rank {e['rank']} did not export the full model")
        seen.append(names)
    if patched and (set.union(*seen) != everything or sum(map(len, seen)) != len(everything)):
        raise AssertionError("the stages' exports do not partition the model")


if __name__ == "__main__":
    sys.exit(main())
