"""Whether SGLang fuses DeepSeek's shared experts into the routed experts.

With fusion, SGLang has no ``mlp.shared_experts.*`` parameters: the shared expert is local
expert slot ``E_local`` of ``mlp.experts.w13_weight`` / ``w2_weight`` on every rank (SGLang
0.5.23, ``resolve_shared_experts_config`` and
``DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason``); a rank's
`ParallelismConfig.num_fused_shared_experts` carries the count (``n_shared_experts`` when
fused, 0 when not). `RankParallelismConfig` does not say so; the server arguments, the
checkpoint's config and the GPU do, and so does the size of a published ``w13_weight``.
"""

from __future__ import annotations

from typing import Any

from weightsync.layout.config import config_data, model_dims
from weightsync.layout.families import family_for


def sglang_fuses_shared_experts(
    hf_config: Any,
    *,
    ep_size: int,
    disable_shared_experts_fusion: bool = False,
    enforce_shared_experts_fusion: bool = False,
    device: str = "cuda",
) -> bool:
    """Whether SGLang 0.5.23 fuses this model's shared experts into its routed experts.

    Follows SGLang's reasons to keep them apart for bf16 and block-FP8 checkpoints on NVIDIA
    GPUs of compute capability 8.0 or newer (no two-batch overlap, no DeepEP-class all-to-all
    backend): fusion is on by default only for ``DeepseekV3ForCausalLM`` checkpoints with 256
    routed experts and one shared expert at ``ep_size == 1`` on CUDA (DeepSeek-V3/R1 at pure
    TP); Kimi-K2 (384 experts), expert parallelism, small test models and the CPU keep them
    apart unless ``--enforce-shared-experts-fusion``. When fused, the rank's
    ``num_fused_shared_experts`` is the config's ``n_shared_experts``.

    Args:
        hf_config: a transformers config object or a config.json dict.
        ep_size: the rollout's expert-parallel size.
        disable_shared_experts_fusion: SGLang's ``--disable-shared-experts-fusion``.
        enforce_shared_experts_fusion: SGLang's ``--enforce-shared-experts-fusion``.
        device: ``"cuda"`` or ``"cpu"`` (SGLang's ``--device``).

    Raises:
        ValueError: as for `weightsync.layout.rank_layout`'s config reading.
    """
    dims = model_dims(hf_config)
    if not family_for(dims.model_type).deepseek_moe or disable_shared_experts_fusion:
        return False
    if enforce_shared_experts_fusion:
        return True
    architectures = config_data(hf_config).get("architectures") or [None]
    return (
        architectures[0] == "DeepseekV3ForCausalLM"
        and dims.num_experts == 256
        and dims.n_shared_experts == 1
        and device == "cuda"
        and ep_size == 1
    )
