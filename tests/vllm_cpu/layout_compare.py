"""weightsync's layouts against the tables vLLM's own loader leaves (`layout_cases`).

Runs in the project's venv. `run_vllm_loader` runs vLLM's loader for a case (`layout_loader.py`
in vLLM's venv, one process per rank); weightsync's side is
`weightsync.receiver.loader.shard_state_dict` (SGLang's layout) of the case's checkpoint for
each rank, in the rows `layout_cases.table_row` makes, compared parameter by parameter with
vLLM's rows of the same rank.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_cpu.launch import free_port
from vllm_cpu.launch import HOST, server_env
from vllm_cpu.layout_cases import CASES, HERE, MODELS, make_state, rank_parallelism, table_row

LOADER = HERE / "layout_loader.py"


@dataclass
class RankComparison:
    """How one rank's parameters compare, by name.

    ``identical``: same shape, dtype and bytes. ``different``: in both, but the shape, dtype
    or bytes differ (name -> what differs). ``renamed``: vLLM's name -> weightsync's name of a
    parameter with the same shape, dtype and bytes under another name. ``only_vllm`` /
    ``only_weightsync``: the other names one side has and the other lacks. ``same_order``:
    both list the parameters they share in the same order (``named_parameters()`` order; it
    does not change what a parameter holds).
    """

    identical: list[str] = field(default_factory=list)
    different: dict[str, str] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    only_vllm: list[str] = field(default_factory=list)
    only_weightsync: list[str] = field(default_factory=list)
    same_order: bool = True

    @property
    def bit_identical(self) -> bool:
        """Every parameter of each side is in the other, under the same name, with the same
        shape, dtype and bytes."""
        return not (self.different or self.renamed or self.only_vllm or self.only_weightsync)


def weightsync_tables(case_name: str) -> list[list[list[Any]]]:
    """Each rank's rows of weightsync's layout for a case, in its own parameter order."""
    from weightsync.layout import hf_tensor_shapes
    from weightsync.receiver.loader import shard_state_dict

    case = CASES[case_name]
    config = MODELS[case["model"]]
    state = make_state(hf_tensor_shapes(config))
    return [
        [
            table_row(name, tensor)
            for name, tensor in shard_state_dict(
                state, config, rank_parallelism(case, rank), "bfloat16"
            ).items()
        ]
        for rank in range(case["tp_size"])
    ]


def compare_rank(vllm_rows: list[list[Any]], our_rows: list[list[Any]]) -> RankComparison:
    """Compare one rank's rows (``[name, shape, dtype, digest]``) of vLLM and weightsync."""
    theirs = {row[0]: row for row in vllm_rows}
    ours = {row[0]: row for row in our_rows}
    result = RankComparison()
    for name, row in theirs.items():
        mine = ours.get(name)
        if mine is None:
            result.only_vllm.append(name)
            continue
        if mine == row:
            result.identical.append(name)
            continue
        what = []
        if mine[1] != row[1]:
            what.append(f"shape vLLM {row[1]} weightsync {mine[1]}")
        if mine[2] != row[2]:
            what.append(f"dtype vLLM {row[2]} weightsync {mine[2]}")
        if not what:
            what.append("bytes")
        result.different[name] = ", ".join(what)
    unmatched = {tuple(map(str, row[1:])): row[0] for n, row in ours.items() if n not in theirs}
    for name in result.only_vllm:
        twin = unmatched.pop(tuple(map(str, theirs[name][1:])), None)
        if twin is not None:
            result.renamed[name] = twin
    result.only_vllm = [name for name in result.only_vllm if name not in result.renamed]
    paired = set(result.renamed.values())
    result.only_weightsync = [name for name in ours if name not in theirs and name not in paired]
    shared = set(theirs) & set(ours)
    result.same_order = [n for n in theirs if n in shared] == [n for n in ours if n in shared]
    return result


def compare_case(case_name: str, vllm_ranks: list[dict[str, Any]]) -> list[RankComparison]:
    """Compare every rank of a stored case (``[{"loaded": rows, ...}, ...]``) with
    weightsync's layout of the same ranks."""
    ours = weightsync_tables(case_name)
    return [compare_rank(rank["loaded"], mine) for rank, mine in zip(vllm_ranks, ours, strict=True)]


def run_vllm_loader(venv: Path, checkpoint: Path, case_name: str, tmp: Path) -> list[dict]:
    """Every rank's table of a case from vLLM's own loader: one process per rank, together.

    Raises:
        RuntimeError: a rank failed or ran past 600 s; the message has its output's tail.
    """
    tp = CASES[case_name]["tp_size"]
    init_method = f"tcp://{HOST}:{free_port()}"
    # One OpenMP thread per rank: the ranks share this machine's cores, and loading is copying.
    env = server_env({"VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "OMP_NUM_THREADS": "1"})
    outs = [tmp / f"{case_name}-rank{rank}.json" for rank in range(tp)]
    logs = [tmp / f"{case_name}-rank{rank}.log" for rank in range(tp)]
    procs = []
    for rank in range(tp):
        with open(logs[rank], "wb") as log:
            procs.append(
                subprocess.Popen(
                    [
                        str(venv / "bin" / "python"),
                        str(LOADER),
                        str(checkpoint),
                        case_name,
                        str(rank),
                        init_method,
                        str(outs[rank]),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
    deadline = time.monotonic() + 600
    # Until all exit 0, one fails (the others would wait on it in a collective), or time is up.
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline or any(proc.returncode for proc in procs):
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- rank {rank} ---\n" + "\n".join(logs[rank].read_text().splitlines()[-40:])
            for rank in failed
        )
        raise RuntimeError(f"{case_name}: vLLM's loader failed on rank(s) {failed}\n{tails}")
    return [json.loads(out.read_text()) for out in outs]
