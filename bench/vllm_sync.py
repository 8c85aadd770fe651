"""A weightsync sync into real vLLM 0.32.0 (its CPU build) against vLLM's own way of taking new
weights on a CPU, the same bytes, in one run.

One vLLM replica (weightsync's worker extension in its workers) serves checkpoint A. Alternating,
``--repeats`` times each, the replica is given checkpoint B then A again:

- ``weightsync``: `weightsync.TrainerSync` pushes the checkpoint's tensors (held in memory by
  the trainer, as after a training step) over Mooncake TCP into the replica's registered memory;
  the extension hands the staged parameters to vLLM's own post-load processing at the end of
  the session. Pause to resume.
- ``vllm reload``: ``/pause``, ``POST /collective_rpc reload_weights`` with ``weights_path``
  (vLLM reads the safetensors from disk, already in the page cache here, loads them through its
  loaders and post-processes them), ``/resume``.
- ``save + reload``: what an RL step pays to use that path: the trainer first writes its
  tensors as safetensors (here into the page cache of the same host: no shared file system,
  no second node), then vLLM reloads them.

Every timed update is checked: the replica's greedy tokens equal transformers' on the
checkpoint it was given. Prints a table and one JSON line (medians): ``bytes``,
``weightsync_s``, ``reload_s``, ``save_s``, ``speedup`` (reload / weightsync),
``speedup_vs_save_reload`` ((save + reload) / weightsync) and the sync's phases (its
``finalize`` holds vLLM's processing of the staged parameters).

    python bench/vllm_sync.py                   # "small" Qwen3 (~130 MB float32), tp1
    python bench/vllm_sync.py --tp 2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from common import log, median, print_table  # noqa: E402
from vllm_cpu.launch import SRC_DIR, ensure_venv, start_vllm  # noqa: E402

EXTENSION = "weightsync.integrations.vllm.WorkerExtension"
PROMPT = (1, 17, 42, 7, 300)
NEW_TOKENS = 4


def main() -> None:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (weightsync.testing)")
    parser.add_argument("--tp", type=int, default=1, help="the replica's tensor parallelism")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates of each kind")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from weightsync.testing.presets import preset_config, write_random_checkpoint
    from weightsync.testing.reference import greedy_tokens

    venv = ensure_venv()
    config = preset_config(args.preset)
    work = Path(tempfile.mkdtemp(prefix="weightsync-vllm-bench-"))
    paths = [
        write_random_checkpoint(work / name, config, dtype=torch.float32, seed=seed)
        for name, seed in (("a", 1), ("b", 2))
    ]
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in paths]
    expected = [greedy_tokens(m, torch.float32, (PROMPT,), NEW_TOKENS)[0] for m in models]
    num_bytes = sum(t.numel() * t.element_size() for t in models[0].state_dict().values())
    log(f"{args.preset}: {num_bytes / 1e6:.0f} MB float32; starting vLLM (tp {args.tp})")
    server = start_vllm(
        venv,
        paths[0],
        tp=args.tp,
        dtype="float32",
        log_path=work / "vllm.log",
        worker_extension_cls=EXTENSION,
        extra_env={"PYTHONPATH": str(SRC_DIR)},
        timeout=900.0,
    )
    sync_config = ws.SyncConfig(
        sender=ws.SenderConfig(bucket_bytes=64 << 20, timeout_s=60),
        control=ws.ControlConfig(http_timeout_s=300.0),
    )
    times: dict[str, list[float]] = {"weightsync": [], "reload": [], "save": []}
    saved = work / "saved"
    phases: list[dict[str, float]] = []
    try:
        with ws.TrainerSync(sync_config, hf_config=models[0].config, replicas=[server.url]) as sync:
            # The first sync learns the replica (the extension captures its weights) and plans.
            sync.sync(ws.ModelExport(models[0]), version="warm")
            for repeat in range(args.repeats):
                for which in (1, 0):
                    start = time.perf_counter()
                    report = sync.sync(ws.ModelExport(models[which]), version=f"w{repeat}{which}")
                    times["weightsync"].append(time.perf_counter() - start)
                    phases.append(report.to_dict()["phases"])
                    _check(server, expected[which], "weightsync")
                    times["reload"].append(_reload(server, paths[which ^ 1]))
                    _check(server, expected[which ^ 1], "vllm reload")
                    times["save"].append(_save(models[which], paths[which], saved))
                    # Back to what the trainer wrote last, for the next sync to change it all.
                    sync.sync(ws.ModelExport(models[which]), version=f"r{repeat}{which}")
    finally:
        server.stop()

    weightsync_s, reload_s = median(times["weightsync"]), median(times["reload"])
    save_s = median(times["save"])
    phase_names = sorted({k for p in phases for k in p})
    medians = {k: median([p[k] for p in phases if k in p]) for k in phase_names}
    print_table(
        f"vLLM 0.32.0 (CPU), {args.preset}, tp {args.tp}: {num_bytes / 1e6:.0f} MB per update, "
        f"medians of {len(times['weightsync'])}",
        ["method", "s", "GB/s", "x reload"],
        [
            [
                "weightsync",
                f"{weightsync_s:.3f}",
                f"{num_bytes / weightsync_s / 1e9:.2f}",
                f"{reload_s / weightsync_s:.2f}",
            ],
            ["vllm reload", f"{reload_s:.3f}", f"{num_bytes / reload_s / 1e9:.2f}", "1.00"],
            [
                "save + reload",
                f"{save_s + reload_s:.3f}",
                f"{num_bytes / (save_s + reload_s) / 1e9:.2f}",
                f"{reload_s / (save_s + reload_s):.2f}",
            ],
        ],
    )
    print("weightsync phases (s): " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    result: dict[str, Any] = {
        "workload": f"vllm-{args.preset}-tp{args.tp}",
        "bytes": num_bytes,
        "weightsync_s": weightsync_s,
        "reload_s": reload_s,
        "speedup": reload_s / weightsync_s,
        "save_s": save_s,
        "speedup_vs_save_reload": (save_s + reload_s) / weightsync_s,
        "phases_s": medians,
        "repeats": len(times["weightsync"]),
    }
    print(json.dumps(result))


def _reload(server: Any, path: Path) -> float:
    """vLLM's own update from disk, paused: its wall time."""
    start = time.perf_counter()
    server.post("/pause?mode=abort")
    reply = server.post(
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
        timeout=600.0,
    )
    if reply.status != 200:
        raise RuntimeError(f"reload_weights failed: {reply.status} {reply.body}")
    server.post("/resume")
    return time.perf_counter() - start


def _save(model: Any, source: Path, folder: Path) -> float:
    """The trainer's side of vLLM's path: write `model`'s tensors as a checkpoint folder
    (safetensors beside `source`'s config); its wall time."""
    import shutil

    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    shutil.copy(source / "config.json", folder / "config.json")
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    start = time.perf_counter()
    save_file(state, str(folder / "model.safetensors"))
    return time.perf_counter() - start


def _check(server: Any, expected: list[int], what: str) -> None:
    served = server.greedy(list(PROMPT), NEW_TOKENS)
    if served != expected:
        raise RuntimeError(f"after {what} vLLM served {served}, transformers {expected}")


if __name__ == "__main__":
    main()
