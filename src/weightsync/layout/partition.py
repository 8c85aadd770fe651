"""How a model's dimensions split over one rollout rank, by SGLang's rules."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.layout.config import ModelDims
from weightsync.layout.families import family_for
from weightsync.layout.parallelism import ParallelismConfig

# SGLang pads the vocabulary of embed_tokens / lm_head to a multiple of this many rows.
VOCAB_PADDING = 64


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Rows of the full (all-rank) embedding table SGLang allocates.

    The vocabulary is padded to a multiple of 64; when that does not split evenly over
    ``tp_size`` ranks it is padded to a multiple of ``64 * tp_size`` instead.
    """
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp_size:
        step = VOCAB_PADDING * tp_size
        padded = -(-vocab_size // step) * step
    return padded


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPartition:
    """The slices of each model dimension that one rank holds (``(start, stop)`` ranges).

    Attributes:
        heads: this rank's attention (query) heads.
        q_rows: rows of ``q_proj`` (this rank's query heads times ``head_dim``); grouped-head
            attention only, ``(0, 0)`` for MLA (whose rows follow from ``heads``).
        kv_rows: rows of ``k_proj`` / ``v_proj`` (this rank's kv heads, replicated when
            ``tp_size > num_key_value_heads``); ``(0, 0)`` for MLA.
        intermediate: the dense MLP's intermediate slice (rows of gate/up, columns of down);
            all of it when ``moe_dense_tp_size`` is 1.
        vocab_rows: the slice of the padded vocabulary of ``embed_tokens`` this rank holds
            (split over attention TP under DP attention); rows at or past ``vocab_size`` are
            padding.
        lm_head_rows: the same for an untied ``lm_head`` (split over attention TP only with
            ``enable_dp_lm_head``).
        experts: the global routed experts this rank holds (``ep_rank`` block).
        moe_intermediate: each expert's intermediate slice (``moe_tp_rank`` block).
        shared_intermediate: DeepSeek's shared experts' intermediate slice
            (``moe_intermediate_size * n_shared_experts`` split over the whole TP group, not
            MoE-TP) when they are not fused; ``(0, 0)`` for other families and when fused.
        num_fused_shared_experts: DeepSeek's shared experts held as extra expert slots after
            the rank's routed experts (slot ``i`` is the shared experts' intermediate block
            ``i`` of ``moe_intermediate_size``, split like a routed expert by
            ``moe_intermediate``); 0 when not fused.
    """

    heads: tuple[int, int]
    q_rows: tuple[int, int]
    kv_rows: tuple[int, int]
    intermediate: tuple[int, int]
    vocab_rows: tuple[int, int]
    lm_head_rows: tuple[int, int]
    experts: tuple[int, int]
    moe_intermediate: tuple[int, int]
    shared_intermediate: tuple[int, int] = (0, 0)
    num_fused_shared_experts: int = 0


def _block(size: int, parts: int, index: int) -> tuple[int, int]:
    step = size // parts
    return (index * step, (index + 1) * step)


def _require_divisible(dims: ModelDims, field: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise ValueError(
            f"{dims.model_type} config: {field}={value} must be divisible by {by_name}={by}"
        )


def _kv_rows(dims: ModelDims, tp_size: int, tp_rank: int) -> tuple[int, int]:
    num_kv = dims.num_key_value_heads
    if num_kv >= tp_size:
        _require_divisible(dims, "num_key_value_heads", num_kv, "tp_size", tp_size)
        num_local_kv = num_kv // tp_size
        kv_start = tp_rank * num_local_kv
    else:
        if tp_size % num_kv:
            raise ValueError(
                f"{dims.model_type} config: num_key_value_heads={num_kv} must divide "
                f"tp_size={tp_size} (or be divisible by it)"
            )
        # Each kv head is replicated on tp_size // num_kv consecutive ranks.
        num_local_kv = 1
        kv_start = tp_rank // (tp_size // num_kv)
    return (kv_start * dims.head_dim, (kv_start + num_local_kv) * dims.head_dim)


def _vocab_rows(vocab_size: int, size: int, rank: int) -> tuple[int, int]:
    per_rank = padded_vocab_size(vocab_size, size) // size
    return (rank * per_rank, (rank + 1) * per_rank)


def _check_parallel_modes(dims: ModelDims, parallelism: ParallelismConfig) -> None:
    """Refuse the parallel modes this family's layout does not cover."""
    family = family_for(dims.model_type)
    if parallelism.pp_size != 1:
        raise ValueError(
            f"pp_size={parallelism.pp_size}: rollout pipeline parallelism is not supported; "
            "use pp_size=1"
        )
    # DP attention and --moe-dense-tp-size are laid out (and checked against SGLang's loader)
    # for the DeepSeek-V3 family; the other families place their heads, MLPs and embeddings
    # under DP attention by rules of their own.
    if parallelism.attn_dp_size != 1 and not family.deepseek_moe:
        raise ValueError(
            f"{dims.model_type}: attn_dp_size={parallelism.attn_dp_size}: attention data "
            "parallelism (--attn-dp-size) is laid out for the DeepSeek-V3 family only"
        )
    if parallelism.moe_dense_tp_size == 1 and parallelism.tp_size > 1 and not family.deepseek_moe:
        raise ValueError(
            f"{dims.model_type}: moe_dense_tp_size=1 (--moe-dense-tp-size) is laid out for "
            "the DeepSeek-V3 family only"
        )
    fused = parallelism.num_fused_shared_experts
    has_moe = any(map(dims.is_moe_layer, range(dims.num_hidden_layers)))
    # DeepseekV2MoE asserts at construction that it fuses all n_shared_experts or none.
    if fused and family.deepseek_moe and has_moe and fused != dims.n_shared_experts:
        raise ValueError(
            f"{dims.model_type}: num_fused_shared_experts={fused} with n_shared_experts="
            f"{dims.n_shared_experts}: SGLang fuses all shared experts or none "
            f"(num_fused_shared_experts 0 or {dims.n_shared_experts}); "
            "--disable-shared-experts-fusion keeps them apart"
        )


def partition_rank(dims: ModelDims, parallelism: ParallelismConfig) -> RankPartition:
    """The slices rank ``parallelism`` holds of a model with sizes ``dims``.

    Attention heads split over attention TP (``attn_tp_size``, the whole TP group without DP
    attention); ``embed_tokens`` likewise, ``lm_head`` over the whole TP group unless
    ``enable_dp_lm_head``; dense MLPs over TP unless ``moe_dense_tp_size`` is 1 (then whole);
    routed experts by EP then MoE-TP across the whole TP group.

    Raises:
        ValueError: a size does not split over the ranks (the message names the config field
            and the parallel size), the parallelism uses a mode SGLang lays out differently
            (pipeline parallelism; DP attention or ``moe_dense_tp_size`` 1 outside the
            DeepSeek-V3 family), a fused shared-expert count other than ``n_shared_experts``
            (SGLang asserts it), or (DeepSeek) ``tp_size`` exceeds the number of routed
            experts, which SGLang refuses.
    """
    _check_parallel_modes(dims, parallelism)
    family = family_for(dims.model_type)
    tp_size, tp_rank = parallelism.tp_size, parallelism.tp_rank
    attn_tp_size, attn_tp_rank = parallelism.attn_tp_size, parallelism.attn_tp_rank
    attn_by = "attn_tp_size" if parallelism.attn_dp_size > 1 else "tp_size"

    _require_divisible(dims, "num_attention_heads", dims.num_attention_heads, attn_by, attn_tp_size)
    heads = _block(dims.num_attention_heads, attn_tp_size, attn_tp_rank)
    q_rows = kv_rows = (0, 0)
    if not family.mla:
        q_rows = (heads[0] * dims.head_dim, heads[1] * dims.head_dim)
        kv_rows = _kv_rows(dims, attn_tp_size, attn_tp_rank)

    moe_layers = [dims.is_moe_layer(layer) for layer in range(dims.num_hidden_layers)]
    # A size only has to split when some layer uses it.
    intermediate = (0, 0)
    if not all(moe_layers):
        if parallelism.moe_dense_tp_size == 1:
            intermediate = (0, dims.intermediate_size)
        else:
            _require_divisible(
                dims, "intermediate_size", dims.intermediate_size, "tp_size", tp_size
            )
            intermediate = _block(dims.intermediate_size, tp_size, tp_rank)

    # SGLang's VocabParallelEmbedding: the attention-TP group under DP attention (it reduces
    # only over the ranks that share a batch), the whole TP group otherwise; ParallelLMHead
    # takes the attention-TP group only with --enable-dp-lm-head.
    vocab_rows = _vocab_rows(dims.vocab_size, attn_tp_size, attn_tp_rank)
    if parallelism.enable_dp_lm_head:
        lm_head_rows = vocab_rows
    else:
        lm_head_rows = _vocab_rows(dims.vocab_size, tp_size, tp_rank)

    experts = moe_intermediate = shared_intermediate = (0, 0)
    num_fused = 0
    if any(moe_layers):
        ep_size, moe_tp_size = parallelism.ep_size, parallelism.moe_tp_size
        # Name the expert count as the family's config.json spells it.
        experts_key = "n_routed_experts" if family.deepseek_moe else "num_experts"
        _require_divisible(dims, experts_key, dims.num_experts, "ep_size", ep_size)
        _require_divisible(
            dims, "moe_intermediate_size", dims.moe_intermediate_size, "moe_tp_size", moe_tp_size
        )
        experts = _block(dims.num_experts, ep_size, parallelism.ep_rank)
        moe_intermediate = _block(dims.moe_intermediate_size, moe_tp_size, parallelism.moe_tp_rank)
        if family.deepseek_moe:
            if tp_size > dims.num_experts:
                raise ValueError(
                    f"{dims.model_type} config: tp_size={tp_size} exceeds n_routed_experts="
                    f"{dims.num_experts}, which SGLang refuses; use tp_size <= "
                    f"{dims.num_experts}"
                )
            num_fused = parallelism.num_fused_shared_experts
            if not num_fused:
                shared_size = dims.moe_intermediate_size * dims.n_shared_experts
                _require_divisible(
                    dims,
                    "moe_intermediate_size * n_shared_experts",
                    shared_size,
                    "tp_size",
                    tp_size,
                )
                shared_intermediate = _block(shared_size, tp_size, tp_rank)
    return RankPartition(
        heads=heads,
        q_rows=q_rows,
        kv_rows=kv_rows,
        intermediate=intermediate,
        vocab_rows=vocab_rows,
        lm_head_rows=lm_head_rows,
        experts=experts,
        moe_intermediate=moe_intermediate,
        shared_intermediate=shared_intermediate,
        num_fused_shared_experts=num_fused,
    )
