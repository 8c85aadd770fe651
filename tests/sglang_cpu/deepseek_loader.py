"""Run SGLang 0.5.23's own DeepSeek-V2/V3 model construction and ``load_weights`` on the CPU for
every rank of one case, and print each rank's parameter table as JSON.

Runs in SGLang's venv (scripts/setup-sglang), with ``stubs/`` on PYTHONPATH and
``SGLANG_USE_CPU_ENGINE=1``:

    python deepseek_loader.py CHECKPOINT_DIR CASE_NAME

and prints ``{"ranks": [[row, ...], ...]}`` (rows as `deepseek_cases.table_row`), one table per
TP rank, each in SGLang's ``named_parameters()`` order, taken right after ``load_weights`` and
before ``process_weights_after_loading`` (whose CPU path needs AMX).

No process group is built: each rank is published with SGLang's own rank placement
(``publish(..., ranks=SpawnRanks(world_rank=r))``, which derives the attention and MoE ranks),
and the group handles the layers read at construction are `RankOnlyGroup`s, which carry a rank
and a width and nothing else. Construction and weight loading only read those two numbers; a
collective reaching a `RankOnlyGroup` fails loudly (it has no communicator).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepseek_cases import CASES, sglang_server_args, table_row


class RankOnlyGroup:
    """A stand-in for SGLang's GroupCoordinator at construction time: a rank and a width."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group = rank
        self.world_size = size
        self.ranks = list(range(size))
        self.first_rank = 0
        self.last_rank = size - 1
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == size - 1
        # Layers keep these handles for their forward passes, which never run here.
        self.cpu_group = None
        self.device_group = None

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"RankOnlyGroup has no {name!r}: no collective runs while loading")


def _install_groups() -> None:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()

    def group(rank: str, size: str) -> RankOnlyGroup:
        return RankOnlyGroup(getattr(parallel, rank), getattr(parallel, size))

    parallel.override_permanently(
        world_group=group("tp_rank", "tp_size"),
        tp_group=group("tp_rank", "tp_size"),
        pp_group=RankOnlyGroup(0, 1),
        attn_tp_group=group("attn_tp_rank", "attn_tp_size"),
        attn_cp_group=RankOnlyGroup(0, 1),
        dcp_group=RankOnlyGroup(0, 1),
        moe_ep_group=group("moe_ep_rank", "moe_ep_size"),
        moe_tp_group=group("moe_tp_rank", "moe_tp_size"),
        moe_dp_group=RankOnlyGroup(0, 1),
    )


def load_rank(checkpoint: Path, case: dict[str, Any], tp_rank: int) -> list[list[Any]]:
    """One rank's parameters after SGLang's ``load_weights``, as table rows."""
    from safetensors.torch import load_file
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.bootstrap import init_layer_runtime
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = ServerArgs(
        model_path=str(checkpoint), device="cpu", dtype="bfloat16", **sglang_server_args(case)
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))
    _install_groups()
    # What SGLang's worker does once its groups exist (distributed/bootstrap.py), before it
    # builds the model: the DP-attention flags the embedding and lm_head read, the layer runtime.
    initialize_dp_attention(server_args=args)
    initialize_moe_config()
    model_config = ModelConfig.from_server_args(args)
    init_layer_runtime(model_config=model_config)
    load_config = LoadConfig()
    # What SGLang's DefaultModelLoader.load_model does, up to its post-processing.
    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = _initialize_model(model_config, load_config, quant_config)
    model.load_weights(iter(load_file(str(checkpoint / "model.safetensors")).items()))
    return [table_row(name, param) for name, param in model.named_parameters()]


def main() -> None:
    """Print the tables of every rank of the case named on the command line."""
    checkpoint, case_name = Path(sys.argv[1]), sys.argv[2]
    case = CASES[case_name]
    ranks = [load_rank(checkpoint, case, rank) for rank in range(case["tp_size"])]
    print(json.dumps({"ranks": ranks}))


if __name__ == "__main__":
    main()
