"""A plainly written reference of what SGLang's loader leaves on one tensor-parallel rank.

It follows SGLang's own loading code step by step: allocate the rank's parameters (in the
order the model's modules register them), then walk the HF checkpoint and hand each tensor
to the parameter's weight loader with its shard id, the way `load_weights` does with
`stacked_params_mapping` and `FusedMoE.make_expert_params_mapping`. It shares no code with
`weightsync.layout` (no segments, no tables), so the two can check each other.

`cfg` is a config.json-style dict that spells out every key it reads (DeepSeek configs may
leave keys out: they take transformers' DeepseekV3Config defaults, `DEEPSEEK_DEFAULTS`).
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
    if cfg["model_type"] in DEEPSEEK_TYPES:
        return deepseek_hf_shapes(cfg)
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
    rank_class = _DeepseekRank if cfg["model_type"] in DEEPSEEK_TYPES else _Rank
    rank = rank_class(cfg, tp_size, tp_rank, ep_size, dtype)
    rank.load_weights(hf)
    return rank.params


# ---- DeepSeek-V3 / Kimi-K2 (SGLang's DeepseekV2ForCausalLM and its weight loader) ----

DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2")

# transformers 5.24's DeepseekV3Config defaults, for keys a config.json leaves out, and the
# router keys SGLang reads (moe_layer_freq, topk_method) at DeepSeek-V3's values.
DEEPSEEK_DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "first_k_dense_replace": 3,
    "tie_word_embeddings": False,
}


def deepseek_config(cfg: dict) -> dict:
    """``cfg`` with transformers' DeepseekV3Config defaults for the keys it leaves out
    (``q_lora_rank: None`` is kept: it means no q low-rank projection)."""
    full = dict(DEEPSEEK_DEFAULTS)
    full.update({k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"})
    if "n_routed_experts" not in cfg and cfg.get("num_experts") is not None:
        full["n_routed_experts"] = cfg["num_experts"]
    return full


def deepseek_is_moe_layer(cfg: dict, layer: int) -> bool:
    """SGLang's rule (moe_layer_freq 1): every layer from first_k_dense_replace on."""
    return layer >= cfg["first_k_dense_replace"]


def deepseek_hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepseekV3 checkpoint, written out from transformers' module code
    (per-expert names as save_pretrained writes them; the router bias is a buffer)."""
    cfg = deepseek_config(cfg)
    d = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    dq = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    rq, rkv, dr = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], d)}
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        if rq is not None:
            shapes[a + "q_a_proj.weight"] = (rq, d)
            shapes[a + "q_a_layernorm.weight"] = (rq,)
            shapes[a + "q_b_proj.weight"] = (heads * dq, rq)
        else:
            shapes[a + "q_proj.weight"] = (heads * dq, d)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (rkv + dr, d)
        shapes[a + "kv_a_layernorm.weight"] = (rkv,)
        shapes[a + "kv_b_proj.weight"] = (
            heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
            rkv,
        )
        shapes[a + "o_proj.weight"] = (d, heads * cfg["v_head_dim"])
        m = f"model.layers.{i}.mlp."
        if deepseek_is_moe_layer(cfg, i):
            im = cfg["moe_intermediate_size"]
            for e in range(cfg["n_routed_experts"]):
                shapes[m + f"experts.{e}.gate_proj.weight"] = (im, d)
                shapes[m + f"experts.{e}.up_proj.weight"] = (im, d)
                shapes[m + f"experts.{e}.down_proj.weight"] = (d, im)
            shapes[m + "gate.weight"] = (cfg["n_routed_experts"], d)
            shapes[m + "gate.e_score_correction_bias"] = (cfg["n_routed_experts"],)
            shared = im * cfg["n_shared_experts"]
            shapes[m + "shared_experts.gate_proj.weight"] = (shared, d)
            shapes[m + "shared_experts.up_proj.weight"] = (shared, d)
            shapes[m + "shared_experts.down_proj.weight"] = (d, shared)
        else:
            shapes[m + "gate_proj.weight"] = (cfg["intermediate_size"], d)
            shapes[m + "up_proj.weight"] = (cfg["intermediate_size"], d)
            shapes[m + "down_proj.weight"] = (d, cfg["intermediate_size"])
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (d,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], d)
    return shapes


class _DeepseekRank:
    """One rank of SGLang's DeepseekV2ForCausalLM: its parameters (registration order) and
    its load_weights (the q_a / kv_a cache-and-concatenate, stacked gate/up, the expert
    mapping, column- / row- / vocab-parallel and replicated weight loaders)."""

    def __init__(self, cfg: dict, tp_size: int, tp_rank: int, ep_size: int, dtype: torch.dtype):
        cfg = deepseek_config(cfg)
        self.cfg = cfg
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.moe_tp_size = tp_size // ep_size
        self.moe_tp_rank = tp_rank % self.moe_tp_size
        self.ep_rank = tp_rank // self.moe_tp_size
        self.num_local_experts = cfg["n_routed_experts"] // ep_size
        self.dtype = dtype
        self.params: dict[str, torch.Tensor] = {}
        self.vocab_per_rank = padded_vocab(cfg["vocab_size"], tp_size) // tp_size

        d = cfg["hidden_size"]
        hl = cfg["num_attention_heads"] // tp_size
        dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        rq, rkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        self.new("model.embed_tokens.weight", self.vocab_per_rank, d)
        for i in range(cfg["num_hidden_layers"]):
            a = f"model.layers.{i}.self_attn."
            if rq is not None:
                self.new(a + "fused_qkv_a_proj_with_mqa.weight", rq + rkv + dr, d)
                self.new(a + "q_a_layernorm.weight", rq)
                self.new(a + "q_b_proj.weight", hl * (dn + dr), rq)
            else:
                self.new(a + "q_proj.weight", hl * (dn + dr), d)
                self.new(a + "kv_a_proj_with_mqa.weight", rkv + dr, d)
            self.new(a + "kv_b_proj.weight", hl * (dn + dv), rkv)
            self.new(a + "o_proj.weight", d, hl * dv)
            self.new(a + "kv_a_layernorm.weight", rkv)
            m = f"model.layers.{i}.mlp."
            if deepseek_is_moe_layer(cfg, i):
                num_experts = cfg["n_routed_experts"]
                im = cfg["moe_intermediate_size"] // self.moe_tp_size
                shared = cfg["moe_intermediate_size"] * cfg["n_shared_experts"] // tp_size
                self.new(m + "gate.weight", num_experts, d)
                self.params[m + "gate.e_score_correction_bias"] = torch.full(
                    (num_experts,), float("nan"), dtype=torch.float32
                )
                self.new(m + "experts.w13_weight", self.num_local_experts, 2 * im, d)
                self.new(m + "experts.w2_weight", self.num_local_experts, d, im)
                self.new(m + "shared_experts.gate_up_proj.weight", 2 * shared, d)
                self.new(m + "shared_experts.down_proj.weight", d, shared)
            else:
                inter = cfg["intermediate_size"] // tp_size
                self.new(m + "gate_up_proj.weight", 2 * inter, d)
                self.new(m + "down_proj.weight", d, inter)
            self.new(f"model.layers.{i}.input_layernorm.weight", d)
            self.new(f"model.layers.{i}.post_attention_layernorm.weight", d)
        self.new("model.norm.weight", d)
        if not cfg["tie_word_embeddings"]:
            self.new("lm_head.weight", self.vocab_per_rank, d)

    def new(self, name: str, *shape: int) -> None:
        # Garbage on purpose: the loaders must write every element.
        self.params[name] = torch.full(shape, float("nan"), dtype=self.dtype)

    def load_column_parallel(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def load_row_parallel(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        param.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def load_merged_column(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        size = param.shape[0] // 2
        param.narrow(0, shard_id * size, size).copy_(loaded.narrow(0, self.tp_rank * size, size))

    def load_vocab_parallel(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        start = self.tp_rank * self.vocab_per_rank
        shard = loaded[start : start + self.vocab_per_rank]
        param[: shard.shape[0]] = shard
        param[shard.shape[0] :] = 0

    def load_expert(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str, expert: int):
        local = expert - self.ep_rank * self.num_local_experts
        if not 0 <= local < self.num_local_experts:
            return
        if shard_id == "w2":
            size = param.shape[2]
            start = loaded.shape[1] // self.moe_tp_size * self.moe_tp_rank
            param[local].copy_(loaded.narrow(1, start, size))
            return
        size = param.shape[1] // 2
        start = loaded.shape[0] // self.moe_tp_size * self.moe_tp_rank
        offset = 0 if shard_id == "w1" else size
        param[local].narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def load_weights(self, hf: dict[str, torch.Tensor]) -> None:
        cached_a: dict[str, torch.Tensor] = {}
        for name, loaded in hf.items():
            if ".mlp.experts." in name:
                layer_part, rest = name.split(".mlp.experts.")
                expert, proj, _ = rest.split(".")
                shard_id = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                suffix = "w2_weight" if shard_id == "w2" else "w13_weight"
                self.load_expert(
                    self.params[f"{layer_part}.mlp.experts.{suffix}"], loaded, shard_id, int(expert)
                )
                continue
            if self.cfg["q_lora_rank"] is not None and (
                "q_a_proj" in name or "kv_a_proj_with_mqa" in name
            ):
                cached_a[name] = loaded
                q_name = name.replace("kv_a_proj_with_mqa", "q_a_proj")
                kv_name = name.replace("q_a_proj", "kv_a_proj_with_mqa")
                if q_name in cached_a and kv_name in cached_a:
                    fused = torch.cat([cached_a[q_name], cached_a[kv_name]], dim=0)
                    param = self.params[q_name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")]
                    assert param.shape == fused.shape
                    param.copy_(fused)
                continue
            for weight_name, shard_id in (("gate_proj", 0), ("up_proj", 1)):
                if weight_name in name:
                    param = self.params[name.replace(weight_name, "gate_up_proj")]
                    self.load_merged_column(param, loaded, shard_id)
                    break
            else:
                param = self.params[name]
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    self.load_vocab_parallel(param, loaded)
                elif any(p in name for p in ("q_b_proj", "q_proj", "kv_b_proj")):
                    self.load_column_parallel(param, loaded)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    self.load_row_parallel(param, loaded)
                else:
                    assert param.shape == loaded.shape, (name, param.shape, loaded.shape)
                    param.copy_(loaded)
