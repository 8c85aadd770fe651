"""Run vLLM 0.32.0's own model construction and ``load_weights`` on the CPU for one rank of one
case of `layout_cases`, and write the rank's parameter table as JSON.

Runs in vLLM's venv (scripts/setup-vllm), one process per rank, the ranks of a case started
together (scripts/vllm-layouts does):

    python layout_loader.py CHECKPOINT_DIR CASE_NAME RANK INIT_METHOD OUT_JSON

The rank joins a real gloo process group (INIT_METHOD, e.g. ``tcp://127.0.0.1:PORT``) with
vLLM's own ``init_worker_distributed_environment``, exactly as a CPU worker does, so the
parallel layers read their ranks and sizes from vLLM's own groups. Then it does what vLLM's
``DefaultModelLoader.load_model`` does, stopping where the layout is still the loader's:
``create_model`` and ``load_weights`` (reading the checkpoint from disk), and records every
parameter. Only then does it run vLLM's ``process_weights_after_loading`` (on CPU it repacks
unquantised linear weights into oneDNN handles and empties the parameters) and records the
same parameters again.

OUT_JSON gets ``{"loaded": [row, ...], "after_processing": [[name, shape, digest,
same_storage], ...]}`` (rows as `layout_cases.table_row`), in vLLM's ``named_parameters()``
order; ``same_storage`` says whether the parameter still has the memory ``load_weights``
filled (shape and digest None, same_storage false, for a parameter that is gone).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_cases import CASES, table_row, vllm_engine_args


def load_rank(checkpoint: Path, case_name: str, rank: int, init_method: str) -> dict:
    """One rank's parameters after vLLM's ``load_weights``, and their shapes after its
    post-processing."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    case = CASES[case_name]
    vllm_config = EngineArgs(model=str(checkpoint), **vllm_engine_args(case)).create_engine_config()
    model_config = vllm_config.model_config
    # What vLLM's CPU worker sets before it joins the group: its shared-memory communicator
    # names its segments after it.
    os.environ["VLLM_DIST_IDENT"] = init_method.split(":")[-1]
    with set_current_vllm_config(vllm_config):
        init_worker_distributed_environment(
            vllm_config, rank, init_method, local_rank=rank, backend="gloo"
        )
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
        loader.load_weights(model, model_config)
        loaded = [table_row(name, param) for name, param in model.named_parameters()]
        storage = {name: param.data_ptr() for name, param in model.named_parameters()}
        process_weights_after_loading(model, model_config, torch.device("cpu"))
        after = dict(model.named_parameters())
    processed = []
    for name, *_ in loaded:
        param = after.get(name)
        if param is None:
            processed.append([name, None, None, False])
        else:
            row = table_row(name, param)
            processed.append([name, row[1], row[3], param.data_ptr() == storage[name]])
    return {"loaded": loaded, "after_processing": processed}


def main() -> None:
    """Write the table of the rank named on the command line."""
    checkpoint, case_name, rank, init_method, out = sys.argv[1:6]
    # vLLM's CPU platform binds OpenMP threads per rank unless told not to; the ranks of a case
    # share this machine's cores with whatever else runs.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    table = load_rank(Path(checkpoint), case_name, int(rank), init_method)
    Path(out).write_text(json.dumps(table))


if __name__ == "__main__":
    main()
