"""A plainly written reference of what SGLang's loader leaves on one tensor-parallel rank.

It follows SGLang's own loading code step by step: allocate the rank's parameters (in the
order the model's modules register them), then walk the HF checkpoint and hand each tensor
to the parameter's weight loader with its shard id, the way `load_weights` does with
`stacked_params_mapping` and `FusedMoE.make_expert_params_mapping`. It shares no code with
`weightsync.layout` (no segments, no tables), so the two can check each other.

`cfg` is a config.json-style dict that spells out every key it reads.
"""

from __future__ import annotations

import torch

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """transformers' rule for which qwen3_moe layers are sparse."""
    if cfg["model_type"] != "qwen3_moe":
        return False
    return (
        layer not in cfg["mlp_only_layers"]
        and cfg["num_experts"] > 0
        and (layer + 1) % cfg["decoder_sparse_step"] == 0
    )


def has_lm_head_param(cfg: dict) -> bool:
    """Dense families share embed_tokens as lm_head when tied; qwen3_moe keeps its own."""
    return not cfg["tie_word_embeddings"] or cfg["model_type"] == "qwen3_moe"


def reference_hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint, written out from the transformers module code."""
    hidden = cfg["hidden_size"]
    head_dim = cfg["head_dim"]
    n_q = cfg["num_attention_heads"] * head_dim
    n_kv = cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (n_q, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (n_kv, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (n_kv, hidden)
        if cfg["model_type"] == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (n_q,)
            shapes[p + "self_attn.k_proj.bias"] = (n_kv,)
            shapes[p + "self_attn.v_proj.bias"] = (n_kv,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, n_q)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        if is_moe_layer(cfg, i):
            inter = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
            shapes[p + "mlp.gate.weight"] = (cfg["num_experts"], hidden)
        else:
            inter = cfg["intermediate_size"]
            shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    """SGLang's pad_vocab_size(vocab, 64), widened to 64 * tp when 64 does not split over tp."""
    padding = 64
    padded = (vocab_size + padding - 1) // padding * padding
    if padded % tp_size != 0:
        padding = 64 * tp_size
        padded = (vocab_size + padding - 1) // padding * padding
    return padded


class _Rank:
    """One rank's model: parameters plus the weight loaders of the layers that own them."""

    def __init__(self, cfg: dict, tp_size: int, tp_rank: int, ep_size: int, dtype: torch.dtype):
        self.cfg = cfg
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.moe_tp_size = tp_size // ep_size
        self.moe_tp_rank = tp_rank % self.moe_tp_size
        self.ep_rank = tp_rank // self.moe_tp_size
        self.num_local_experts = cfg.get("num_experts", 0) // ep_size
        self.dtype = dtype
        self.params: dict[str, torch.Tensor] = {}

        hidden = cfg["hidden_size"]
        self.head_dim = cfg["head_dim"]
        total_kv = cfg["num_key_value_heads"]
        self.num_heads = cfg["num_attention_heads"] // tp_size
        if tp_size >= total_kv:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_kv
        else:
            self.num_kv_heads = total_kv // tp_size
            self.num_kv_head_replicas = 1
        self.vocab_per_rank = padded_vocab(cfg["vocab_size"], tp_size) // tp_size
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        model_type = cfg["model_type"]

        self.new("model.embed_tokens.weight", self.vocab_per_rank, hidden)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            if model_type == "qwen3":
                self.new(p + "self_attn.q_norm.weight", self.head_dim)
                self.new(p + "self_attn.k_norm.weight", self.head_dim)
            self.new(p + "self_attn.qkv_proj.weight", qkv_rows, hidden)
            if model_type == "qwen2":
                self.new(p + "self_attn.qkv_proj.bias", qkv_rows)
            self.new(p + "self_attn.o_proj.weight", hidden, self.num_heads * self.head_dim)
            if model_type == "qwen3_moe":
                self.new(p + "self_attn.q_norm.weight", self.head_dim)
                self.new(p + "self_attn.k_norm.weight", self.head_dim)
            if is_moe_layer(cfg, i):
                inter = cfg["moe_intermediate_size"] // self.moe_tp_size
                self.new(p + "mlp.experts.w13_weight", self.num_local_experts, 2 * inter, hidden)
                self.new(p + "mlp.experts.w2_weight", self.num_local_experts, hidden, inter)
                self.new(p + "mlp.gate.weight", cfg["num_experts"], hidden)
            else:
                inter = cfg["intermediate_size"] // tp_size
                self.new(p + "mlp.gate_up_proj.weight", 2 * inter, hidden)
                self.new(p + "mlp.down_proj.weight", hidden, inter)
            self.new(p + "input_layernorm.weight", hidden)
            self.new(p + "post_attention_layernorm.weight", hidden)
        self.new("model.norm.weight", hidden)
        if has_lm_head_param(cfg):
            self.new("lm_head.weight", self.vocab_per_rank, hidden)

    def new(self, name: str, *shape: int) -> None:
        # Filled with garbage on purpose: the loaders must write every element.
        self.params[name] = torch.full(shape, float("nan"), dtype=self.dtype)

    # ---- weight loaders, one per SGLang layer class ----

    def load_vocab_parallel(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        start = self.tp_rank * self.vocab_per_rank
        shard = loaded[start : start + self.vocab_per_rank]
        param[: shard.shape[0]] = shard
        param[shard.shape[0] :] = 0

    def load_qkv(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        elif shard_id == "k":
            kv_index = self.tp_rank // self.num_kv_head_replicas
            offset, size, start = q_size, kv_size, kv_index * kv_size
        else:
            kv_index = self.tp_rank // self.num_kv_head_replicas
            offset, size, start = q_size + kv_size, kv_size, kv_index * kv_size
        param[offset : offset + size] = loaded[start : start + size]

    def load_merged_column(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        size = param.shape[0] // 2
        start = self.tp_rank * size
        param[shard_id * size : (shard_id + 1) * size] = loaded[start : start + size]

    def load_row_parallel(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        start = self.tp_rank * size
        param[:, :] = loaded[:, start : start + size]

    def load_expert(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        local_id = expert_id - self.ep_rank * self.num_local_experts
        if not 0 <= local_id < self.num_local_experts:
            return
        expert = param[local_id]
        if shard_id in ("w1", "w3"):
            size = expert.shape[0] // 2
            start = self.moe_tp_rank * size
            piece = loaded[start : start + size]
            if shard_id == "w1":
                expert[:size] = piece
            else:
                expert[size:] = piece
        else:
            size = expert.shape[1]
            start = self.moe_tp_rank * size
            expert[:, :] = loaded[:, start : start + size]

    def load_default(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        assert param.shape == loaded.shape, (param.shape, loaded.shape)
        param.copy_(loaded)

    # ---- load_weights ----

    def load_weights(self, hf: dict[str, torch.Tensor]) -> None:
        stacked = [
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        for name, loaded in hf.items():
            if ".mlp.experts." in name:
                layer_part, rest = name.split(".mlp.experts.")
                expert_id_text, proj, _ = rest.split(".")
                shard_id = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                param_suffix = "w2_weight" if shard_id == "w2" else "w13_weight"
                param = self.params[f"{layer_part}.mlp.experts.{param_suffix}"]
                self.load_expert(param, loaded, shard_id, int(expert_id_text))
                continue
            for param_name, weight_name, shard_id in stacked:
                if weight_name in name:
                    param = self.params[name.replace(weight_name, param_name)]
                    if param_name == "qkv_proj":
                        self.load_qkv(param, loaded, shard_id)
                    else:
                        self.load_merged_column(param, loaded, shard_id)
                    break
            else:
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    self.load_vocab_parallel(self.params[name], loaded)
                elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    self.load_row_parallel(self.params[name], loaded)
                else:
                    self.load_default(self.params[name], loaded)
        if self.cfg["tie_word_embeddings"] and "lm_head.weight" in self.params:
            self.load_vocab_parallel(self.params["lm_head.weight"], hf["model.embed_tokens.weight"])


def reference_shard(
    hf: dict[str, torch.Tensor],
    cfg: dict,
    *,
    tp_size: int,
    tp_rank: int,
    ep_size: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """What SGLang's loader leaves on rank ``tp_rank`` after loading the HF tensors ``hf``."""
    rank = _Rank(cfg, tp_size, tp_rank, ep_size, dtype)
    rank.load_weights(hf)
    return rank.params
