"""DeepSeek-V3 / Kimi-K2 under the parallel settings people serve them with: fused shared
experts, DP attention (with and without ``--enable-dp-lm-head``) and ``--moe-dense-tp-size 1``.

Worked tables of where the fused slot and the attention-TP rows come from, and a property:
for random configs and settings, the ranks' segments together rebuild every HF tensor, and
every element two ranks both hold (replicated attention across attention-DP groups, the fused
shared expert on every EP rank, whole dense layers) is the same element. Bit-exactness against
SGLang's own loader is `test_layout_sglang_deepseek.py`'s.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.layout import ParallelismConfig, hf_tensor_shapes, rank_layout
from weightsync.receiver.loader import shard_state_dict
from weightsync.testing.presets import preset_config


def _boxes(layout) -> list[tuple[str | None, tuple]]:
    return [(s.hf_name, s.src_box) for s in layout.segments]


def test_fused_shared_expert_is_the_last_slot_of_every_ep_rank() -> None:
    config = preset_config("tiny-deepseek")  # 8 routed experts of 256, one shared of 256
    m = "model.layers.1.mlp."
    # tp 4, ep 2: moe_tp 2, so rank 3 holds experts 4..7 and the shared expert, rows 128..255.
    layout = rank_layout(config, ParallelismConfig(tp_size=4, tp_rank=3, ep_size=2, **_FUSED))
    w13, w2 = layout[m + "experts.w13_weight"], layout[m + "experts.w2_weight"]
    assert w13.shape == (4 + 1, 2 * 128, 256) and w2.shape == (4 + 1, 256, 128)
    assert _boxes(w13)[0] == (m + "experts.4.gate_proj.weight", ((128, 256), (0, 256)))
    assert _boxes(w13)[-2:] == [
        (m + "shared_experts.gate_proj.weight", ((128, 256), (0, 256))),
        (m + "shared_experts.up_proj.weight", ((128, 256), (0, 256))),
    ]
    assert _boxes(w2)[-1] == (m + "shared_experts.down_proj.weight", ((0, 256), (128, 256)))
    assert not any("shared_experts" in name for name in layout)


_FUSED = {"num_fused_shared_experts": 1}


def test_dp_attention_splits_attention_and_embeddings_over_attention_tp() -> None:
    config = preset_config("tiny-deepseek")  # 4 heads, vocab 1000 padded to 1024
    a = "model.layers.1.self_attn."
    for dp_lm_head in (False, True):
        # tp 4 = attention DP 2 x attention TP 2: rank 3 is attention-TP rank 1 of group 1.
        par = ParallelismConfig(tp_size=4, tp_rank=3, attn_dp_size=2, enable_dp_lm_head=dp_lm_head)
        layout = rank_layout(config, par)
        assert _boxes(layout[a + "q_b_proj.weight"]) == [
            (a + "q_b_proj.weight", ((2 * 192, 4 * 192), (0, 128)))
        ]
        assert _boxes(layout[a + "o_proj.weight"]) == [
            (a + "o_proj.weight", ((0, 256), (2 * 128, 4 * 128)))
        ]
        # embed_tokens: rows 512..1023 of the padded table, 488 real and 24 of padding.
        embed = layout["model.embed_tokens.weight"]
        assert embed.shape == (512, 256)
        assert [(s.hf_name, s.numel) for s in embed.segments] == [
            ("model.embed_tokens.weight", 488 * 256),
            (None, 24 * 256),
        ]
        # lm_head: over attention TP with --enable-dp-lm-head, over all of TP without.
        assert layout["lm_head.weight"].shape == ((512, 256) if dp_lm_head else (256, 256))
        # The MoE and the shared experts stay over the whole TP group.
        assert layout["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (256, 64)
        assert layout["model.layers.1.mlp.experts.w13_weight"].shape == (8, 2 * 64, 256)
    # Rank 1 of attention-DP group 0 holds the same attention as rank 3.
    same = rank_layout(config, ParallelismConfig(tp_size=4, tp_rank=1, attn_dp_size=2))
    other = rank_layout(config, ParallelismConfig(tp_size=4, tp_rank=3, attn_dp_size=2))
    assert same[a + "kv_b_proj.weight"] == other[a + "kv_b_proj.weight"]
    assert same["model.embed_tokens.weight"] == other["model.embed_tokens.weight"]


def test_moe_dense_tp_size_1_keeps_dense_layers_whole() -> None:
    config = preset_config("tiny-deepseek")
    layout = rank_layout(config, ParallelismConfig(tp_size=4, tp_rank=2, moe_dense_tp_size=1))
    m = "model.layers.0.mlp."
    assert layout[m + "gate_up_proj.weight"].shape == (2 * 512, 256)
    assert _boxes(layout[m + "down_proj.weight"]) == [
        (m + "down_proj.weight", ((0, 256), (0, 512)))
    ]
    # SGLang 0.5.23 keeps the unfused shared experts on the TP group ("tp") whatever the
    # dense TP size: only the dense layers are replicated.
    assert layout["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape == (2 * 64, 256)


@st.composite
def cases(draw: st.DrawFn) -> dict:
    """A random small DeepSeek config and one of the parallel settings SGLang runs it with."""
    tp_size = draw(st.sampled_from([1, 2, 4]))
    ep_size = draw(st.sampled_from([d for d in (1, 2, 4) if tp_size % d == 0]))
    attn_dp_size = draw(st.sampled_from([d for d in (1, 2, 4) if tp_size % d == 0]))
    attn_tp_size = tp_size // attn_dp_size
    fused = draw(st.booleans())
    num_layers = draw(st.integers(1, 3))
    cfg = {
        "model_type": draw(st.sampled_from(["deepseek_v3", "kimi_k2"])),
        "vocab_size": draw(st.integers(1, 200)),
        "hidden_size": draw(st.sampled_from([4, 8])),
        "intermediate_size": tp_size * draw(st.integers(1, 2)),
        "moe_intermediate_size": tp_size * draw(st.integers(1, 2)),
        "num_hidden_layers": num_layers,
        "num_attention_heads": attn_tp_size * draw(st.integers(1, 2)),
        "q_lora_rank": draw(st.sampled_from([None, 3])),
        "kv_lora_rank": 2,
        "qk_nope_head_dim": 2,
        "qk_rope_head_dim": 2,
        "v_head_dim": 3,
        "n_routed_experts": max(tp_size, ep_size) * draw(st.integers(1, 2)),
        "n_shared_experts": 1 if fused else draw(st.integers(1, 2)),
        "first_k_dense_replace": draw(st.integers(0, num_layers)),
        "tie_word_embeddings": draw(st.booleans()),
        "dtype": "float32",
    }
    parallelism = {
        "tp_size": tp_size,
        "ep_size": ep_size,
        "attn_dp_size": attn_dp_size,
        "num_fused_shared_experts": 1 if fused else 0,
        "enable_dp_lm_head": draw(st.booleans()) and attn_dp_size > 1,
        "moe_dense_tp_size": draw(st.sampled_from([None, 1, tp_size])),
    }
    return {"cfg": cfg, "parallelism": parallelism, "seed": draw(st.integers(0, 2**31 - 1))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_ranks_rebuild_every_tensor_and_agree_where_they_overlap(case: dict) -> None:
    cfg, par = case["cfg"], case["parallelism"]
    gen = torch.Generator().manual_seed(case["seed"])
    shapes = hf_tensor_shapes(cfg)
    hf = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    rebuilt = {name: torch.zeros(shape) for name, shape in shapes.items()}
    covered = {name: torch.zeros(shape, dtype=torch.bool) for name, shape in shapes.items()}
    for tp_rank in range(par["tp_size"]):
        parallelism = ParallelismConfig(tp_rank=tp_rank, **par)
        layouts = rank_layout(cfg, parallelism)
        shards = shard_state_dict(hf, cfg, parallelism)
        assert list(shards) == list(layouts)
        for name, layout in layouts.items():
            flat = shards[name].view(-1)
            for segment in layout.segments:
                piece = flat[segment.dst_offset : segment.dst_offset + segment.numel]
                if segment.is_padding:
                    assert torch.count_nonzero(piece) == 0
                    continue
                box_shape = tuple(b - a for a, b in segment.src_box)
                assert math.prod(box_shape) == segment.numel
                slices = tuple(slice(a, b) for a, b in segment.src_box)
                piece = piece.view(box_shape)
                assert torch.equal(piece, hf[segment.hf_name][slices]), (name, tp_rank)
                seen = covered[segment.hf_name][slices]
                assert torch.equal(rebuilt[segment.hf_name][slices][seen], piece[seen])
                rebuilt[segment.hf_name][slices] = piece
                covered[segment.hf_name][slices] = True
    for name in shapes:
        assert bool(covered[name].all()), f"{name} not fully covered ({par})"
