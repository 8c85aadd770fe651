"""Property tests of the layout rules over random configs of every family and parallelism.

For each random case: every rank's `shard_state_dict` equals the independent reference loader,
the segments of every parameter tile it exactly once, padding is zero, and gathering every
rank's segments back rebuilds every HF tensor exactly.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference_loader import reference_hf_shapes, reference_shard
from weightsync.layout import (
    SUPPORTED_MODEL_TYPES,
    ParallelismConfig,
    hf_tensor_shapes,
    rank_layout,
)
from weightsync.receiver.loader import shard_state_dict
from weightsync.torch_dtypes import torch_dtype


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def cases(draw: st.DrawFn) -> dict:
    """A random small model config plus a rollout tp_size / ep_size it splits over."""
    model_type = draw(st.sampled_from(SUPPORTED_MODEL_TYPES))
    tp_size = draw(st.integers(1, 8))
    # kv heads either divide tp (replicated over ranks) or are a multiple of it (partitioned).
    if draw(st.booleans()):
        num_kv = draw(st.sampled_from(_divisors(tp_size)))
    else:
        num_kv = tp_size * draw(st.integers(1, 2))
    num_heads = max(num_kv, tp_size) * draw(st.integers(1, 2))
    num_layers = draw(st.integers(1, 3))
    cfg = {
        "model_type": model_type,
        "vocab_size": draw(st.integers(1, 200)),
        "hidden_size": draw(st.sampled_from([4, 8, 12])),
        "intermediate_size": tp_size * draw(st.integers(1, 3)),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv,
        "head_dim": draw(st.sampled_from([2, 4])),
        "tie_word_embeddings": draw(st.booleans()),
        "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
    }
    ep_size = 1
    if model_type == "qwen3_moe":
        ep_size = draw(st.sampled_from(_divisors(tp_size)))
        moe_tp_size = tp_size // ep_size
        cfg |= {
            "num_experts": ep_size * draw(st.integers(1, 3)),
            "moe_intermediate_size": moe_tp_size * draw(st.integers(1, 2)),
            "decoder_sparse_step": draw(st.integers(1, 2)),
            "mlp_only_layers": draw(st.lists(st.integers(0, num_layers - 1), unique=True)),
        }
    rollout_dtype = draw(st.sampled_from([None, torch.float32, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return {
        "cfg": cfg,
        "tp_size": tp_size,
        "ep_size": ep_size,
        "dtype": rollout_dtype,
        "seed": seed,
    }


def _random_hf(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _box_slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_shards_match_reference_and_reassemble(case: dict) -> None:
    cfg, tp_size, ep_size = case["cfg"], case["tp_size"], case["ep_size"]
    expected_shapes = reference_hf_shapes(cfg)
    assert hf_tensor_shapes(cfg) == expected_shapes
    hf = _random_hf(expected_shapes, case["seed"])
    dtype = case["dtype"] if case["dtype"] is not None else torch_dtype(cfg["dtype"])

    rebuilt = {name: torch.zeros(shape, dtype=dtype) for name, shape in expected_shapes.items()}
    covered = {
        name: torch.zeros(shape, dtype=torch.bool) for name, shape in expected_shapes.items()
    }
    for tp_rank in range(tp_size):
        parallelism = ParallelismConfig(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size)
        # Both accepted spellings of the parallelism config, alternating by rank.
        par_arg = parallelism if tp_rank % 2 else parallelism.to_dict()
        layouts = rank_layout(cfg, par_arg, case["dtype"])
        shards = shard_state_dict(hf, cfg, par_arg, case["dtype"])
        reference = reference_shard(
            hf, cfg, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, dtype=dtype
        )

        assert list(shards) == list(reference) == list(layouts)
        for name, layout in layouts.items():
            shard = shards[name]
            assert shard.dtype == dtype and layout.dtype == str(dtype).removeprefix("torch.")
            assert tuple(shard.shape) == layout.shape == tuple(reference[name].shape)
            assert torch.equal(shard, reference[name]), (name, tp_rank)

            # Segments tile [0, numel) once, in order; each is one box of one HF tensor.
            flat = shard.view(-1)
            offset = 0
            for segment in layout.segments:
                assert segment.dst_offset == offset and segment.numel > 0
                offset += segment.numel
                piece = flat[segment.dst_offset : segment.dst_offset + segment.numel]
                if segment.is_padding:
                    assert segment.src_box == ()
                    assert torch.count_nonzero(piece) == 0
                    continue
                hf_shape = expected_shapes[segment.hf_name]
                assert len(segment.src_box) == len(hf_shape)
                assert all(
                    0 <= a < b <= n for (a, b), n in zip(segment.src_box, hf_shape, strict=True)
                )
                box_shape = tuple(b - a for a, b in segment.src_box)
                assert math.prod(box_shape) == segment.numel
                slices = _box_slices(segment.src_box)
                piece = piece.view(box_shape)
                seen = covered[segment.hf_name][slices]
                # Replicated elements must agree on every rank that holds them.
                assert torch.equal(rebuilt[segment.hf_name][slices][seen], piece[seen])
                rebuilt[segment.hf_name][slices] = piece
                covered[segment.hf_name][slices] = True
            assert offset == layout.numel

    for name, tensor in hf.items():
        assert bool(covered[name].all()), f"{name} not fully covered"
        assert torch.equal(rebuilt[name], tensor.to(dtype)), name
