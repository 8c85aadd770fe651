"""Dense and MoE layouts against vLLM 0.32.0's own weight loader (its CPU build).

`vllm_cpu/layouts.json` holds, for every case of `vllm_cpu.layout_cases.CASES` (tiny Qwen3,
Qwen2 with tied embeddings, Llama and Qwen3-MoE at tp 1 and 2, Qwen3 at tp 4 with KV heads
replicated, Qwen3-MoE with vLLM's expert parallelism) and every rank, each parameter vLLM's
``load_weights`` left: name, shape, dtype and a digest of its bytes, and the same parameters
after vLLM's CPU post-processing. ``scripts/vllm-layouts`` rebuilds the tables by running vLLM's
loader on the CPU. Here weightsync's `shard_state_dict` (SGLang's layout) shards the same
deterministic checkpoint: every parameter has vLLM's shape, dtype and bytes, and all but the
MoE experts vLLM's name too. The ``vllm`` test runs vLLM's loader live on one case.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import pytest

from vllm_cpu.layout_cases import CASES, MODELS, TABLES_PATH, VLLM_VERSION, write_checkpoint
from vllm_cpu.layout_compare import compare_case
from weightsync.layout import hf_tensor_shapes

# vLLM 0.32 holds a FusedMoE's weights in its `routed_experts` submodule; SGLang's layout
# names them on the layer itself.
_EXPERTS = re.compile(r"\.mlp\.experts\.(w13_weight|w2_weight)$")
# The linear layers whose weights vLLM's CPU post-processing repacks into oneDNN handles,
# leaving the parameter empty (MoE routers are such linear layers).
_REPACKED = re.compile(r"\.(qkv_proj|o_proj|gate_up_proj|down_proj|mlp\.gate)\.weight$")


@functools.cache
def _stored() -> dict[str, Any]:
    return json.loads(TABLES_PATH.read_text())


def _vllm_expert_name(name: str) -> str:
    return _EXPERTS.sub(r".mlp.experts.routed_experts.\1", name)


def test_tables_cover_every_case() -> None:
    """The stored tables are vLLM 0.32.0's, one per case as the cases define it, one table
    per rank."""
    stored = _stored()
    assert stored["vllm"] == VLLM_VERSION
    assert list(stored["cases"]) == list(CASES)
    for name, entry in stored["cases"].items():
        assert entry["case"] == CASES[name], f"{name}: rerun scripts/vllm-layouts --case {name}"
        assert len(entry["ranks"]) == CASES[name]["tp_size"]


@pytest.mark.parametrize("case_name", list(CASES))
def test_weightsync_layout_matches_vllm(case_name: str) -> None:
    """Every parameter of every rank has vLLM's shape, dtype and bytes (concatenation order of
    fused qkv and gate_up, TP split, vocabulary padding, KV-head replication, expert placement
    under EP); the names are vLLM's but for the MoE experts' (``routed_experts``)."""
    for rank, cmp in enumerate(compare_case(case_name, _stored()["cases"][case_name]["ranks"])):
        where = f"{case_name} rank {rank}"
        assert not cmp.different, f"{where}: {cmp.different}"
        assert not cmp.only_vllm, f"{where}: only vLLM has {cmp.only_vllm}"
        assert not cmp.only_weightsync, f"{where}: only weightsync has {cmp.only_weightsync}"
        assert cmp.renamed == {_vllm_expert_name(ours): ours for ours in cmp.renamed.values()}
        experts = [name for name in cmp.identical + list(cmp.renamed) if "experts" in name]
        assert sorted(experts) == sorted(cmp.renamed), f"{where}: {experts}"


@pytest.mark.parametrize("case_name", list(CASES))
def test_cpu_post_processing_moves_linear_weights(case_name: str) -> None:
    """What vLLM's CPU post-processing does to the memory ``load_weights`` filled, that is,
    which parameters a one-sided write into that memory would reach: the dense linear weights
    (and MoE routers) become empty parameters (repacked into oneDNN handles); the experts get
    new memory holding other bytes, the same shape or padded (repacked for the CPU MoE kernel);
    embeddings, lm_head, norms and biases keep their memory and bytes. (Keeping them is not
    the same as being read there: vLLM's CPU processing of the embedding layers also derives
    a oneDNN copy of ``lm_head`` that the logits come from, which is why weightsync's vLLM
    extension processes those layers again at every session end.)"""
    for rank, table in enumerate(_stored()["cases"][case_name]["ranks"]):
        loaded = {row[0]: row for row in table["loaded"]}
        for name, shape, digest, same_storage in table["after_processing"]:
            where = f"{case_name} rank {rank}: {name}"
            _, loaded_shape, _, loaded_digest = loaded[name]
            if _REPACKED.search(name):
                assert shape == [0], where
            elif ".routed_experts." in name:
                # With MoE tensor parallelism the slice of the intermediate size (16 here) is
                # padded too (to 32).
                assert len(shape) == len(loaded_shape), where
                assert all(a >= b for a, b in zip(shape, loaded_shape, strict=True)), where
                assert digest != loaded_digest and not same_storage, where
            else:
                assert (shape, digest, same_storage) == (loaded_shape, loaded_digest, True), where


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loader_live(tmp_path) -> None:
    """vLLM's loader, run now, gives the stored tables (MoE at EP 2: two ranks in a gloo
    group)."""
    from vllm_cpu.fixtures import vllm_venv_or_skip
    from vllm_cpu.layout_compare import run_vllm_loader

    venv = vllm_venv_or_skip()
    case_name = "qwen3_moe-tp2-ep"
    config = MODELS[CASES[case_name]["model"]]
    checkpoint = write_checkpoint(tmp_path / "ckpt", hf_tensor_shapes(config), config)
    ranks = run_vllm_loader(venv, checkpoint, case_name, tmp_path)
    stored = _stored()["cases"][case_name]["ranks"]
    assert len(ranks) == len(stored)
    for rank, (live, table) in enumerate(zip(ranks, stored, strict=True)):
        assert live.keys() == table.keys()
        for key in live.keys() - {"after_processing"}:
            assert live[key] == table[key], f"rank {rank}: {key}"
        loaded = {row[0]: row for row in live["loaded"]}
        after = live["after_processing"]
        assert [row[0] for row in after] == [row[0] for row in table["after_processing"]]
        for now, kept in zip(after, table["after_processing"], strict=True):
            name, shape, digest, same_storage = now
            _, loaded_shape, _, loaded_digest = loaded[name]
            # vLLM's CPU build repacks a linear weight into oneDNN only where its dispatch
            # takes oneDNN for it (the stored tables come from an AVX-512 host); elsewhere
            # the weight keeps its memory and bytes, which the extension measures either way.
            in_place = [shape, digest, same_storage] == [loaded_shape, loaded_digest, True]
            assert now == kept or (_REPACKED.search(name) and in_place), f"rank {rank}: {now}"
