"""A simulated cluster: fake but consistent rollout targets and trainer holdings.

`weightsync plan` and the tests plan syncs for clusters that do not exist; these functions
produce the inputs such a cluster would give `build_plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from weightsync.layout import hf_tensor_shapes, layer_index, model_dtype, rank_layout
from weightsync.layout.config import model_dims
from weightsync.layout.families import family_for
from weightsync.layout.names import layer_prefix
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.layout.quant import SCALE_SUFFIX
from weightsync.plan.types import SourceHolding, TargetRank, TensorMeta

EMBED_TOKENS = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"

# Each simulated rank gets its own 1 TiB window of fake addresses.
_ADDRESS_WINDOW = 1 << 40


def simulate_targets(
    hf_config: Any,
    *,
    tp: int,
    ep: int = 1,
    replicas: int = 1,
    dtype: Any = None,
    attn_dp: int = 1,
    fused_shared_experts: bool = False,
    moe_dense_tp_size: int | None = None,
    dp_lm_head: bool = False,
) -> list[TargetRank]:
    """Rollout ranks of `replicas` replicas of `tp` ranks each, as they would publish themselves.

    Replica ``r`` is named ``"replica{r}"``; its rank ``k`` has session id
    ``"replica{r}-rank{k}:0"`` and lays its parameters out back to back, in the engine's order,
    from address ``(1 + r * tp + k) * 2**40``. A block-FP8 config's ranks also publish what
    SGLang registers beside an FP8 checkpoint's weights: every attention layer's float32
    ``k_scale`` / ``v_scale`` (engine-owned, `weightsync.plan.engine_owned`). Each rank's
    parallelism is what SGLang derives for these settings (attention TP and DP ranks inside
    the TP group); like SGLang's ``RankParallelismConfig`` it does not say whether the shared
    experts are fused, which `build_plan` reads from the published ``w13_weight``.

    Args:
        hf_config: the model's transformers config or config.json dict.
        tp: tensor-parallel size of each replica.
        ep: expert-parallel size (divides `tp`).
        replicas: number of replicas.
        dtype: the rollout dtype; default the config's.
        attn_dp: attention data-parallel groups inside the TP group (SGLang's
            ``--attn-dp-size``, or ``--dp-size`` with ``--enable-dp-attention``).
        fused_shared_experts: DeepSeek's shared experts fused into the routed experts as
            ``n_shared_experts`` extra slots (SGLang's default for DeepSeek-V3 at pure TP on
            H100/H200; ``--enforce-shared-experts-fusion``).
        moe_dense_tp_size: SGLang's ``--moe-dense-tp-size`` (None, 1 or `tp`).
        dp_lm_head: SGLang's ``--enable-dp-lm-head`` (needs `attn_dp` > 1).

    Returns:
        ``replicas * tp`` targets, replica by replica, rank by rank.

    Raises:
        ValueError: a size below 1, settings SGLang refuses, or a parallelism the model's
            dims do not split over.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if dp_lm_head and attn_dp == 1:
        raise ValueError("dp_lm_head needs attention DP (attn_dp > 1), as SGLang requires")
    dims = model_dims(hf_config)
    num_fused = dims.n_shared_experts if fused_shared_experts else 0
    if fused_shared_experts and not (family_for(dims.model_type).deepseek_moe and num_fused):
        raise ValueError(
            f"{dims.model_type}: fused shared experts need DeepSeek-style shared experts "
            "(n_shared_experts)"
        )
    kv_scales = _kv_scale_names(hf_config) if dims.fp8_block_size else []
    targets = []
    for replica in range(replicas):
        for rank in range(tp):
            parallelism = ParallelismConfig(
                tp_size=tp,
                tp_rank=rank,
                ep_size=ep,
                attn_dp_size=attn_dp,
                moe_dense_tp_size=moe_dense_tp_size,
                enable_dp_lm_head=dp_lm_head,
            )
            published = dataclasses.replace(parallelism, num_fused_shared_experts=num_fused)
            address = (1 + replica * tp + rank) * _ADDRESS_WINDOW
            weights_info: dict[str, tuple[int, int, int]] = {}
            for name, param in rank_layout(hf_config, published, dtype).items():
                weights_info[name] = (address, param.numel, param.element_size)
                address += param.num_bytes
            for name in kv_scales:
                weights_info[name] = (address, 1, 4)
                address += 4
            targets.append(
                TargetRank(
                    replica=f"replica{replica}",
                    rank=rank,
                    session_id=f"replica{replica}-rank{rank}:0",
                    parallelism=parallelism,
                    weights_info=weights_info,
                )
            )
    return targets


def _kv_scale_names(hf_config: Any) -> list[str]:
    """The ``k_scale`` / ``v_scale`` SGLang registers on every attention layer's
    ``RadixAttention`` of an FP8 checkpoint (MLA has two: ``attn_mqa`` and ``attn_mha``)."""
    dims = model_dims(hf_config)
    modules = ("attn_mqa", "attn_mha") if family_for(dims.model_type).mla else ("attn",)
    return [
        f"{layer_prefix(layer)}self_attn.{module}.{scale}"
        for layer in range(dims.num_hidden_layers)
        for module in modules
        for scale in ("k_scale", "v_scale")
    ]


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The decoder layers of each of `pp` pipeline stages: contiguous, sizes differing by <= 1.

    Raises:
        ValueError: fewer layers than stages.
    """
    if pp < 1 or num_layers < pp:
        raise ValueError(f"pp={pp} stages need 1 <= pp <= num_layers={num_layers}")
    return [range(s * num_layers // pp, (s + 1) * num_layers // pp) for s in range(pp)]


def simulate_sources(hf_config: Any, *, num_sources: int, pp: int = 1) -> list[SourceHolding]:
    """Trainer source ranks: `pp` pipeline stages times ``num_sources // pp`` data-parallel copies.

    Stage ``s`` holds its contiguous slice of the decoder layers (`stage_layers`); stage 0
    also holds ``model.embed_tokens.weight``; the last stage holds ``model.norm.weight`` and
    ``lm_head.weight`` (with tied embeddings, ``model.embed_tokens.weight`` instead, as the
    output layer needs it). Source rank ``dp_index * pp + stage``; every copy of a stage holds
    the same tensors, in checkpoint order, in the config's dtype (a block-FP8 checkpoint's
    quantised weights in e4m3, their scales in float32).

    Args:
        hf_config: the model's transformers config or config.json dict.
        num_sources: number of trainer source ranks; a multiple of `pp`.
        pp: number of pipeline stages.

    Returns:
        The holdings, sorted by rank.

    Raises:
        ValueError: `num_sources` not a positive multiple of `pp`, or more stages than layers.
    """
    if pp < 1 or num_sources < 1 or num_sources % pp:
        raise ValueError(
            f"num_sources={num_sources} must be a positive multiple of pp={pp} "
            "(each pipeline stage has the same number of data-parallel copies)"
        )
    shapes = hf_tensor_shapes(hf_config)
    dtype = model_dtype(hf_config)
    layers = [index for name in shapes if (index := layer_index(name)) is not None]
    stages = stage_layers(max(layers) + 1, pp)
    stage_of_layer = {layer: s for s, block in enumerate(stages) for layer in block}
    tied = LM_HEAD not in shapes

    def stages_of(name: str) -> set[int]:
        index = layer_index(name)
        if index is not None:
            return {stage_of_layer[index]}
        if name == EMBED_TOKENS:
            return {0, pp - 1} if tied else {0}
        return {pp - 1}

    # A block-FP8 checkpoint lists each quantised weight's scale after it: the trainer then
    # holds what `weightsync.export.Fp8Export` yields, e4m3 weights and float32 scales.
    scaled = {name.removesuffix(SCALE_SUFFIX) for name in shapes if name.endswith(SCALE_SUFFIX)}

    def dtype_of(name: str) -> str:
        if name.endswith(SCALE_SUFFIX):
            return "float32"
        return "float8_e4m3fn" if name in scaled else dtype

    holdings = {
        stage: {
            name: TensorMeta(shape=shape, dtype=dtype_of(name))
            for name, shape in shapes.items()
            if stage in stages_of(name)
        }
        for stage in range(pp)
    }
    return [
        SourceHolding(rank=dp_index * pp + stage, tensors=holdings[stage])
        for dp_index in range(num_sources // pp)
        for stage in range(pp)
    ]
