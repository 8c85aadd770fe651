"""What a rollout rank's published parameters say about its layout where its server's
arguments cannot: whether SGLang fused DeepSeek's shared experts into the routed experts.

SGLang decides fusion by the GPU's compute capability (``DeepseekV2ForCausalLM.
shared_experts_fusion_disable_reason``) and its ``/model_info`` carries no ``hf_config``, so
neither ``/server_info`` nor SGLang's ``RankParallelismConfig`` says it. A rank's
``mlp.experts.w13_weight`` does: it holds ``num_local_routed + num_fused_shared_experts``
expert slots of one routed expert's size (``FusedMoE.num_local_experts``), and SGLang fuses
either none or all ``n_shared_experts``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from weightsync.layout import layer_index, rank_layout
from weightsync.layout.config import model_dims
from weightsync.layout.families import family_for
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.plan.types import TargetRank

_W13 = ".mlp.experts.w13_weight"


def published_fused_shared_experts(
    hf_config: Any, target: TargetRank
) -> tuple[int | None, list[str]]:
    """How many shared experts `target`'s published ``w13_weight`` holds as expert slots.

    Returns:
        ``(count, problems)``: the count (None when the model has no DeepSeek MoE layer, the
        rank publishes none of its ``w13_weight``, or there are problems), and one sentence
        per layer whose published size is not a whole number of expert slots, or holds a
        number of fused slots SGLang does not make (0 or ``n_shared_experts``), or differs
        from the other layers'.
    """
    fused, problems = _fused_count(hf_config, target.parallelism, _w13_sizes(target))
    return fused, [f"{target.label}: {problem}" for problem in problems]


def _w13_sizes(target: TargetRank) -> tuple[tuple[str, int], ...]:
    return tuple(
        (name, entry[1]) for name, entry in target.weights_info.items() if name.endswith(_W13)
    )


def _fused_count(
    hf_config: Any, parallelism: ParallelismConfig, sizes: tuple[tuple[str, int], ...]
) -> tuple[int | None, list[str]]:
    """`published_fused_shared_experts` for a rank of `parallelism` publishing `sizes`
    (``(name, numel)`` of its ``w13_weight``), problems without the rank's label."""
    dims = model_dims(hf_config)
    if not family_for(dims.model_type).deepseek_moe or not dims.num_experts or not sizes:
        return None, []
    layout = rank_layout(hf_config, dataclasses.replace(parallelism, num_fused_shared_experts=0))
    counts: dict[int, list[int]] = {}
    problems: list[str] = []
    for name, numel in sizes:
        param = layout.get(name)
        if param is None:
            continue  # a layer the layout does not have: check_targets reports it
        num_routed = param.shape[0]
        slot = param.numel // num_routed
        if numel % slot:
            problems.append(
                f"{name!r} has {numel} elements, not a whole number of expert slots of {slot} "
                f"({num_routed} routed expert(s) here): the replica published a size no "
                "SGLang layout has"
            )
            continue
        fused = numel // slot - num_routed
        if fused not in (0, dims.n_shared_experts):
            problems.append(
                f"{name!r} holds {numel // slot} expert slots for {num_routed} routed "
                f"expert(s): {fused} fused shared expert(s), but SGLang fuses none or all "
                f"n_shared_experts={dims.n_shared_experts}"
            )
            continue
        counts.setdefault(fused, []).append(layer_index(name) or 0)
    if len(counts) > 1:
        by_count = ", ".join(
            f"{count} in layers {sorted(layers)}" for count, layers in sorted(counts.items())
        )
        problems.append(
            f"its layers fuse different numbers of shared experts ({by_count}): SGLang fuses "
            "every MoE layer alike"
        )
    if problems or not counts:
        return None, problems
    return next(iter(counts)), []


def served_targets(
    hf_config: Any, targets: Sequence[TargetRank]
) -> tuple[list[TargetRank], list[str]]:
    """`targets` with the fused shared experts their published parameters show.

    A rank whose parallelism says no fusion (SGLang publishes none) gets the count its
    ``w13_weight`` holds; one whose parallelism says a count its parameters contradict is a
    problem. Ranks of one layout that publish the same sizes are read once.

    Returns:
        ``(targets, problems)``; problems name the rank, the parameter and the sizes.
    """
    resolved: list[TargetRank] = []
    problems: list[str] = []
    counted: dict[tuple[Any, ...], tuple[int | None, list[str]]] = {}
    for target in targets:
        sizes = _w13_sizes(target)
        key = (target.parallelism.layout_key(), sizes)
        if key not in counted:
            counted[key] = _fused_count(hf_config, target.parallelism, sizes)
        fused, found = counted[key]
        problems += [f"{target.label}: {problem}" for problem in found]
        declared = target.parallelism.num_fused_shared_experts
        if fused is None or fused == declared:
            resolved.append(target)
        elif declared:
            problems.append(
                f"{target.label}: its parallelism config says {declared} fused shared "
                f"expert(s), its published mlp.experts.w13_weight holds {fused}"
            )
            resolved.append(target)
        else:
            parallelism = dataclasses.replace(target.parallelism, num_fused_shared_experts=fused)
            resolved.append(dataclasses.replace(target, parallelism=parallelism))
    return resolved, problems
