"""The pure pieces of the broadcast baseline: the engine-side loader, flattened buckets,
bucket planning and seeded synthetic weights."""

from __future__ import annotations

import random

import pytest
import torch

from weightsync.baseline import plan_buckets
from weightsync.baseline.flat_bucket import FLAT_ALIGN_BYTES, FlatBucketLayout
from weightsync.engine.synthetic import synthetic_hf_tensors, synthetic_tensor
from weightsync.errors import LayoutMismatchError
from weightsync.layout import ParallelismConfig, hf_tensor_shapes
from weightsync.plan import SourceHolding, TensorMeta, stage_layers
from weightsync.receiver.loader import load_hf_tensors, load_index, shard_state_dict
from weightsync.testing.presets import preset_config

CASES = [
    ("tiny", {}, ParallelismConfig(tp_size=2, tp_rank=1)),
    ("tiny", {"tie_word_embeddings": True}, ParallelismConfig(tp_size=4, tp_rank=2)),
    ("tiny", {"num_key_value_heads": 1}, ParallelismConfig(tp_size=4, tp_rank=3)),
    ("tiny-moe", {}, ParallelismConfig(tp_size=4, tp_rank=3, ep_size=2)),
    ("tiny-moe", {}, ParallelismConfig(tp_size=2, tp_rank=0)),
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.int16)


@pytest.mark.parametrize(("preset", "overrides", "parallelism"), CASES)
def test_loading_tensor_by_tensor_equals_the_sharded_state_dict(preset, overrides, parallelism):
    config = preset_config(preset, **overrides)
    hf = dict(synthetic_hf_tensors(config, seed=5, dtype="float32"))
    expected = shard_state_dict(hf, config, parallelism, "bfloat16")
    # Parameters full of garbage (padding included), tensors in a random order, in chunks
    # as buckets bring them.
    params = {n: torch.randn(t.shape).to(torch.bfloat16) for n, t in expected.items()}
    items = list(hf.items())
    random.Random(1).shuffle(items)
    used = 0
    for start in range(0, len(items), 7):
        used += load_hf_tensors(params, items[start : start + 7], config, parallelism, "bfloat16")
    for name, tensor in expected.items():
        assert torch.equal(_bits(params[name]), _bits(tensor)), name
    # Every tensor is used, except the experts another EP rank holds.
    index = load_index(config, parallelism, "bfloat16")
    unused = [name for name in hf if not index.targets[name]]
    assert used == len(hf) - len(unused)
    assert all(".mlp.experts." in name for name in unused)
    assert bool(unused) == (parallelism.ep_size > 1)


def test_a_subset_loads_only_its_parameters():
    config = preset_config("tiny")
    par = ParallelismConfig(tp_size=2, tp_rank=0)
    hf = dict(synthetic_hf_tensors(config, seed=1, dtype="float32"))
    full = shard_state_dict(hf, config, par, "float32")
    params = {n: torch.zeros_like(t) for n, t in full.items()}
    k_name = "model.layers.1.self_attn.k_proj.weight"
    qkv_name = "model.layers.1.self_attn.qkv_proj.weight"
    assert load_hf_tensors(params, {k_name: hf[k_name]}, config, par) == 1
    qkv = params[qkv_name]
    q_rows = full["model.layers.1.self_attn.o_proj.weight"].shape[1]
    k_rows = slice(q_rows, q_rows + (qkv.shape[0] - q_rows) // 2)
    assert torch.equal(qkv[k_rows], full[qkv_name][k_rows])
    assert qkv[k_rows].any()
    assert not qkv[: k_rows.start].any() and not qkv[k_rows.stop :].any()
    assert not any(params[n].any() for n in params if n != qkv_name)


def test_loader_refuses_foreign_or_misshapen_tensors_before_copying():
    config = preset_config("tiny")
    par = ParallelismConfig(tp_size=2, tp_rank=0)
    shapes = hf_tensor_shapes(config)
    params = {
        n: torch.zeros_like(t)
        for n, t in shard_state_dict(
            dict(synthetic_hf_tensors(config, seed=1, dtype="float32")), config, par
        ).items()
    }
    good = ("model.norm.weight", torch.ones(shapes["model.norm.weight"]))
    with pytest.raises(ValueError, match=r"'model\.bogus' is not a tensor.*tp_rank=0/2"):
        load_hf_tensors(params, [good, ("model.bogus", torch.ones(3))], config, par)
    with pytest.raises(ValueError, match=r"has shape \(3,\), expected \(64,\)"):
        load_hf_tensors(params, [good, ("model.norm.weight", torch.ones(3))], config, par)
    assert not params["model.norm.weight"].any()  # nothing was copied
    del params["model.norm.weight"]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is missing"):
        load_hf_tensors(params, [good], config, par)


def test_flat_bucket_layout_aligns_every_tensor_and_views_round_trip():
    names = ["a", "b", "c"]
    dtypes = ["bfloat16", "float32", "bf16"]
    shapes = [[3, 5], [7], [0]]
    layout = FlatBucketLayout.from_metadata(names, dtypes, shapes)
    assert [s.offset_bytes for s in layout.spans] == [0, FLAT_ALIGN_BYTES, 2 * FLAT_ALIGN_BYTES]
    assert layout.spans[2].dtype == "bfloat16" and layout.num_bytes == 2 * FLAT_ALIGN_BYTES
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    values = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7), "c": torch.ones(0)}
    for name, view in layout.views(buffer):
        view.copy_(values[name])
    again = dict(FlatBucketLayout.from_metadata(names, dtypes, shapes).views(buffer.clone()))
    assert torch.equal(again["a"], values["a"]) and torch.equal(again["b"], values["b"])
    with pytest.raises(ValueError, match="one entry per tensor"):
        FlatBucketLayout.from_metadata(names, dtypes[:2], shapes)
    with pytest.raises(ValueError, match="unsupported dtype"):
        FlatBucketLayout.from_metadata(["a"], ["complex64"], [[1]])
    with pytest.raises(ValueError, match="smaller than the bucket"):
        list(layout.views(buffer[:10]))


def _holdings(config, pp_size: int) -> list[SourceHolding]:
    shapes = hf_tensor_shapes(config)
    stages = stage_layers(config["num_hidden_layers"], pp_size)
    holdings = []
    for rank, layers in enumerate(stages):
        names = [
            n
            for n in shapes
            if (".layers." in n and int(n.split(".")[2]) in layers)
            or (n == "model.embed_tokens.weight" and rank == 0)
            or (n in ("model.norm.weight", "lm_head.weight") and rank == pp_size - 1)
        ]
        holdings.append(
            SourceHolding(
                rank=rank,
                tensors={n: TensorMeta(shape=shapes[n], dtype="torch.float32") for n in names},
            )
        )
    return holdings


def test_buckets_cover_the_checkpoint_once_with_owners_by_stage():
    config = preset_config("tiny")
    shapes = hf_tensor_shapes(config)
    holdings = _holdings(config, pp_size=2)
    buckets = plan_buckets(holdings, hf_config=config, dtype="bfloat16", bucket_bytes=40_000)
    names = [n for b in buckets for n in b.names]
    assert sorted(names) == sorted(shapes)
    assert len(buckets) > 3
    for bucket in buckets:
        assert bucket.dtypes == ["bfloat16"] * len(bucket.names)
        big = any(2 * torch.Size(shapes[n]).numel() > 40_000 for n in bucket.names)
        assert bucket.num_bytes <= 40_000 + FLAT_ALIGN_BYTES * len(bucket.names) or big
        for name, owner in zip(bucket.names, bucket.owners, strict=True):
            assert name in holdings[owner].tensors
    # Stage 0's tensors first (rank 0 supplies them), then stage 1's.
    owners = [o for b in buckets for o in b.owners]
    assert owners == sorted(owners) and set(owners) == {0, 1}
    # With every rank holding everything, rank 0 supplies all of it, in one bucket.
    (whole,) = _holdings(config, pp_size=1)
    both = [SourceHolding(rank=1, tensors=whole.tensors), whole]
    (bucket,) = plan_buckets(both, hf_config=config, dtype="float32", bucket_bytes=1 << 30)
    assert set(bucket.owners) == {0} and len(bucket.names) == len(shapes)


def test_bucket_planning_names_what_is_wrong():
    config = preset_config("tiny")
    holdings = _holdings(config, pp_size=2)
    with pytest.raises(ValueError, match="no trainer rank holds 1 checkpoint tensor"):
        partial = dict(holdings[1].tensors)
        del partial["model.norm.weight"]
        plan_buckets(
            [holdings[0], SourceHolding(rank=1, tensors=partial)],
            hf_config=config,
            dtype="bfloat16",
            bucket_bytes=1 << 20,
        )
    wrong = dict(holdings[1].tensors)
    wrong["model.norm.weight"] = TensorMeta(shape=(65,), dtype="torch.float32")
    with pytest.raises(LayoutMismatchError, match=r"rank 1 holds 'model.norm.weight'.*\(65,\)"):
        plan_buckets(
            [holdings[0], SourceHolding(rank=1, tensors=wrong)],
            hf_config=config,
            dtype="bfloat16",
            bucket_bytes=1 << 20,
        )


def test_synthetic_tensors_depend_on_name_and_seed_only():
    a = synthetic_tensor("model.norm.weight", (64,), seed=3, dtype="float32")
    b = dict(synthetic_hf_tensors(preset_config("tiny"), seed=3, dtype="bfloat16"))
    assert torch.equal(a.to(torch.bfloat16), b["model.norm.weight"])
    assert (a - 1).abs().max() <= 0.05  # norms near 1
    assert not torch.equal(a, synthetic_tensor("model.norm.weight", (64,), seed=4, dtype="float32"))
    other = synthetic_tensor("lm_head.weight", (10, 4), seed=3, dtype="float32")
    assert other.abs().max() <= 0.05
    with pytest.raises(ValueError, match="not tensors of this model"):
        list(synthetic_hf_tensors(preset_config("tiny"), seed=0, dtype="float32", names=["x"]))
