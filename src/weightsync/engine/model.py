"""The reference engine's model: one TP rank of a causal LM, with SGLang's parameters."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from weightsync.engine.cache import KVCache, LatentCache
from weightsync.engine.decoder import Decoder
from weightsync.engine.embedding import ParallelLMHead, parallel_lm_head
from weightsync.engine.groups import model_groups
from weightsync.engine.mla import MLAttention
from weightsync.engine.parameters import LayoutParameters
from weightsync.engine.spec import ModelSpec
from weightsync.layout import rank_layout
from weightsync.layout.parallelism import ParallelismConfig
from weightsync.receiver.loader import shard_state_dict
from weightsync.torch_dtypes import torch_dtype


def _parallelism(parallelism: ParallelismConfig | Mapping[str, Any]) -> ParallelismConfig:
    config = (
        parallelism
        if isinstance(parallelism, ParallelismConfig)
        else ParallelismConfig.from_dict(parallelism)
    )
    if config.pp_size != 1:
        raise ValueError(f"the reference engine has no pipeline parallelism; got {config}")
    return config


class ReferenceModel(torch.nn.Module):
    """One TP rank of a llama / mistral / qwen2 / qwen3 / qwen3_moe / DeepSeek-V3 (Kimi-K2)
    causal LM.

    The parameters are allocated from ``weightsync.layout.rank_layout`` and
    ``named_parameters()`` yields exactly its names, shapes and order, so the rank's parameter
    table is what SGLang would publish. Their memory never moves after construction (loading
    copies into it), so it can be registered with a transport once.

    DeepSeek-V3 / Kimi-K2 also run as SGLang serves them at scale: with fused shared experts
    (``num_fused_shared_experts``: the experts' last slots, chosen for every token), with DP
    attention (``attn_dp_size > 1``: attention and ``embed_tokens`` split over attention-DP
    groups of ``attn_tp_size`` ranks, the MoE over the whole TP group; see
    `weightsync.engine.groups`) and with ``moe_dense_tp_size == 1`` (dense MLPs whole on
    every rank). The shapes of all of these come from the layout.

    Call protocol: every TP rank builds the model with the same config and its own
    parallelism (with DP attention, every process of the default process group builds it at
    the same point: it creates the attention-DP groups), loads weights (`load_checkpoint` or
    `load_hf_state_dict`, all ranks), then all ranks run the same forward passes (`forward`,
    or ``generate``) in the same order; each forward pass runs collectives over ``group``
    (and its attention-DP subgroups). Whoever writes the parameters' bytes by other
    means (a sync, the weights checker) calls `post_load` before the next forward pass.

    Args:
        hf_config: a transformers config or a config.json dict.
        parallelism: this rank's `ParallelismConfig` (or a dict of its fields); no pipeline
            parallelism.
        dtype: the parameters' dtype (a torch dtype or a name such as ``"bfloat16"``); a
            parameter the layout keeps in another dtype (DeepSeek's router bias, float32)
            keeps it.
        device: where the parameters live (``"cpu"``, ``"cuda:0"``).
        compute_dtype: the dtype activations are computed in; default float32 on CPU (CPUs
            have no fast half-precision matmul, and float32 makes the engine's tokens those of
            an HF float32 model over the same stored weights) and ``dtype`` elsewhere.
        group: the process group of the replica's TP ranks, in TP-rank order (gloo for a CPU
            model, NCCL for a CUDA one); ``None`` at ``tp_size == 1``. A model with
            ``tp_size > 1`` and no group can be built and loaded but not run.

    Raises:
        ValueError: an unsupported model or parallelism, or a group that does not match it.
    """

    def __init__(
        self,
        hf_config: Any,
        parallelism: ParallelismConfig | Mapping[str, Any],
        *,
        dtype: torch.dtype | str,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        compute_dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self._mla: list[MLAttention] | None = None
        self.parallelism = _parallelism(parallelism)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else torch_dtype(dtype)
        self.device = torch.device(device)
        if compute_dtype is None:
            compute_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.compute_dtype = (
            compute_dtype if isinstance(compute_dtype, torch.dtype) else torch_dtype(compute_dtype)
        )
        self.layout = rank_layout(hf_config, self.parallelism, self.dtype)
        self.groups = model_groups(group, self.parallelism)
        self.tp_group = self.groups.tp
        params = LayoutParameters(self.layout, device=self.device)
        self.model = Decoder(
            params=params,
            spec=self.spec,
            groups=self.groups,
            parallelism=self.parallelism,
            compute_dtype=self.compute_dtype,
        )
        # Tied embeddings have no lm_head parameter: the head reads embed_tokens' weight.
        self.lm_head = (
            ParallelLMHead(params.take("lm_head.weight")) if params.has("lm_head.weight") else None
        )
        params.arrange(self)

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank (1 when they are replicated over the TP ranks; MLA: 1, the
        compressed latent every head reads)."""
        if self.spec.mla is not None:
            return 1
        return self.model.layers[0].self_attn.num_kv_heads

    def new_cache(self, capacity: int) -> KVCache | LatentCache:
        """An empty cache for one sequence of up to ``capacity`` positions: keys and values
        of this rank's KV heads, or MLA's compressed latents (`LatentCache`)."""
        if self.spec.mla is not None:
            return LatentCache(
                num_layers=self.spec.num_layers,
                entry_dim=self.spec.mla.cache_entry_dim,
                capacity=capacity,
                dtype=self.compute_dtype,
                device=self.device,
            )
        return KVCache(
            num_layers=self.spec.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.spec.head_dim,
            capacity=capacity,
            dtype=self.compute_dtype,
            device=self.device,
        )

    @torch.no_grad()
    def post_load(self) -> None:
        """Derive what the engine keeps beside its parameters from their current bytes, as
        SGLang's ``post_load_weights`` does: MLA's ``w_kc`` / ``w_vc`` from each layer's
        ``kv_b_proj`` (a no-op for the other families).

        Bytes written into the parameters without the model's loaders (a one-sided sync, the
        weights checker's ``reset_tensors``) leave them stale: call this after every such write
        and before the next forward pass, on every rank (the server does at the end of each
        weight-update session). `load_hf_state_dict` and `load_checkpoint` call it themselves.
        """
        if self._mla is None:
            # The modules never change after construction; walking them costs ~0.1 ms.
            self._mla = [m for m in self.modules() if isinstance(m, MLAttention)]
        for module in self._mla:
            module.post_load()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Logits of one sequence's tokens.

        Args:
            input_ids: ``[num_tokens]`` token ids (int64, on the model's device).
            positions: ``[num_tokens]`` their positions; with a cache, they continue the
                cached sequence.
            cache: this sequence's KV cache, or ``None`` to attend among ``input_ids`` only.

        Returns:
            ``[num_tokens, vocab_size]`` logits over the real vocabulary, gathered over the
            TP ranks (equal on every rank), in the compute dtype.

        Raises:
            ValueError: bad shapes, positions beyond the cache, or no group at ``tp_size > 1``.
        """
        return self.compute_logits(self.hidden_states(input_ids, positions, cache))

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """The final-norm hidden states ``[num_tokens, hidden]``; see `forward` for the args.

        Raises:
            ValueError: bad shapes, positions beyond the cache, or no group at ``tp_size > 1``.
        """
        self.groups.check_can_communicate()
        if input_ids.dim() != 1 or positions.shape != input_ids.shape or input_ids.numel() == 0:
            raise ValueError(
                "input_ids and positions must be equal-length non-empty 1-D tensors, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if cache is not None:
            cache.begin_forward(positions)
        return self.model(input_ids, positions, cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_tokens, vocab_size]`` of final hidden states, gathered over the LM
        head's group (the embedding's when the embeddings are tied)."""
        if self.lm_head is not None:
            weight, group = self.lm_head.weight, self.groups.lm_head
        else:
            weight, group = self.model.embed_tokens.weight, self.groups.attention
        return parallel_lm_head(hidden, weight, group, self.spec.vocab_size)

    @torch.no_grad()
    def load_hf_state_dict(self, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named full tensors into this rank's parameters, in place.

        The tensors are sharded by ``weightsync.layout.shard_state_dict`` (the same rule a
        sync uses) and copied into the existing parameters: their memory does not move. Then
        `post_load` derives what depends on them.

        Raises:
            ValueError: a tensor is missing or has the wrong shape.
        """
        shards = shard_state_dict(hf_state_dict, self.hf_config, self.parallelism, self.dtype)
        params = dict(self.named_parameters())
        missing = [name for name in params if name not in shards]
        if missing:
            raise ValueError(
                f"rank {self.parallelism.tp_rank}: the sharded state dict lacks {missing[:5]}"
            )
        for name, param in params.items():
            shard = shards[name]
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"rank {self.parallelism.tp_rank}: {name} has shape {tuple(param.shape)}, "
                    f"the sharded tensor {tuple(shard.shape)}"
                )
            param.copy_(shard)
        self.post_load()

    def load_checkpoint(self, path: str | Path) -> None:
        """Load every ``*.safetensors`` file of an HF checkpoint folder (see `load_hf_state_dict`).

        Raises:
            ValueError: no safetensors file in ``path``, or a tensor missing or misshapen.
        """
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        hf_state_dict: dict[str, torch.Tensor] = {}
        for file in files:
            hf_state_dict.update(load_file(file, device="cpu"))
        self.load_hf_state_dict(hf_state_dict)
