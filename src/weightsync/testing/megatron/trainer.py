"""A tiny Megatron-core trainer on a CPU: a Qwen3 or Qwen3-MoE shaped ``GPTModel`` under
TP / PP / EP on gloo, trained a few real steps, and Megatron-Bridge's export as the oracle.

Megatron's pipeline schedules, its DDP and its optimizer need CUDA, so the trainer drives its
pipeline stages by hand (``set_input_tensor`` and gloo send / recv), reduces gradients as
``finalize_model_grads`` would (q / k norm grads summed over TP, dense grads averaged over
data parallel, expert grads over expert data parallel) and steps ``torch.optim.AdamW``.

    trainer = MegatronTrainer(preset_config("tiny"), tp=2, pp=2)   # world = 4 ranks
    trainer.train(steps=2)
    export = trainer.export()          # weightsync.export.megatron.MegatronExport
    oracle = trainer.bridge_state()    # collective: every rank gets every HF tensor
    trainer.close()
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.export.megatron import MegatronExport
from weightsync.testing.megatron import shims
from weightsync.testing.presets import build_hf_config

VOCAB_DIVISOR = 128
"""Megatron pads the vocab to a multiple of this times TP (``make_vocab_size_divisible_by``)."""


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocab size Megatron-LM gives the model: rounded up to ``VOCAB_DIVISOR * tp``."""
    multiple = VOCAB_DIVISOR * tp
    return -(-vocab_size // multiple) * multiple


class MegatronTrainer:
    """A ``GPTModel`` on this rank, its optimizer, and the parallel groups it lives in.

    The default process group must be initialised (gloo) with ``tp * pp * dp`` ranks;
    data parallel takes the rest. ``close`` destroys Megatron's groups, so one process may
    build trainers of several shapes one after another.
    """

    def __init__(
        self,
        config: dict[str, Any],
        *,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        vpp: int | None = None,
        first_stage_layers: int | None = None,
        seed: int = 1234,
        lr: float = 1e-2,
    ) -> None:
        """Initialise Megatron's groups and build this rank's pipeline stage of `config`.

        Args:
            config: the HF config.json dict (``qwen3`` or ``qwen3_moe``; a MoE's layers must
                all be MoE layers).
            tp, pp, ep: tensor, pipeline and expert parallel sizes (expert TP is 1 when
                ``ep > 1``: MoE with TP > 1 trains only with sequence parallel, which needs
                Transformer Engine).
            vpp: virtual pipeline stages per PP rank (``chunks`` then holds one model per
                stage; such a trainer exports but does not `train`).
            first_stage_layers: layers of the first pipeline stage, for uneven stages (the
                other stages split the rest).
            seed: every rank's torch seed (the weights are drawn whole and split).
            lr: AdamW's learning rate.

        Raises:
            ValueError: a config the trainer cannot build.
        """
        shims.apply_core()
        from megatron.core import parallel_state

        self.config = dict(config)
        self.hf_config = build_hf_config(config)
        moe = self.config["model_type"] == "qwen3_moe"
        if moe and self.config.get("mlp_only_layers"):
            raise ValueError("MegatronTrainer builds MoE models whose layers are all MoE layers")
        if moe and tp > 1:
            raise ValueError("MegatronTrainer trains MoE models at tp=1 (use ep for experts)")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1 if moe else None,
        )
        shims.after_parallel_init(seed)
        self.tp, self.pp, self.ep, self.vpp = tp, pp, ep, vpp
        self.first_stage_layers = first_stage_layers
        self.chunks = [self._build(moe, stage) for stage in range(vpp or 1)]
        self.model = self.chunks[0]
        params = [p for chunk in self.chunks for p in chunk.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        self.steps_done = 0

    def _build(self, moe: bool, stage: int) -> torch.nn.Module:
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        hf = self.hf_config
        options: dict[str, Any] = {}
        if moe:
            options = {
                "num_moe_experts": hf.num_experts,
                "moe_ffn_hidden_size": hf.moe_intermediate_size,
                "moe_router_topk": hf.num_experts_per_tok,
                "moe_router_pre_softmax": not hf.norm_topk_prob,
                "moe_token_dispatcher_type": "allgather",
                "moe_grouped_gemm": False,
                "moe_permute_fusion": False,
                "moe_router_load_balancing_type": "aux_loss",
                "moe_aux_loss_coeff": 1e-3,
                "moe_router_dtype": "fp32",
            }
        config = TransformerConfig(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads,
            kv_channels=hf.head_dim,
            ffn_hidden_size=hf.intermediate_size,
            normalization="RMSNorm",
            layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=1 if moe else self.tp,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            # Weights drawn whole on the CPU and split; every fused kernel off.
            use_cpu_initialization=True,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            cross_entropy_loss_fusion=False,
            virtual_pipeline_model_parallel_size=self.vpp,
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            **options,
        )
        tied = bool(hf.tie_word_embeddings)
        # Megatron-Bridge reads it from the model's config.
        config.share_embeddings_and_output_weights = tied
        spec = get_gpt_layer_local_spec(
            num_experts=hf.num_experts if moe else None,
            moe_grouped_gemm=False,
            qk_layernorm=True,
            normalization="RMSNorm",
        )
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        num_stages = self.vpp or 1
        rope = getattr(hf, "rope_parameters", None) or {}
        with shims.cuda_is_noop():
            return GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab(hf.vocab_size, self.tp),
                max_sequence_length=hf.max_position_embeddings,
                pre_process=pp_rank == 0 and stage == 0,
                post_process=pp_rank == self.pp - 1 and stage == num_stages - 1,
                share_embeddings_and_output_weights=tied,
                position_embedding_type="rope",
                rotary_base=int(rope.get("rope_theta", 1_000_000)),
                vp_stage=stage if self.vpp else None,
            )

    def train(self, steps: int = 1, *, batch: int = 2, seq_len: int = 16) -> list[float]:
        """Run `steps` optimizer steps on seeded random tokens (each data-parallel rank its
        own); collective over every rank. Returns the losses, on the last stage (else [])."""
        from megatron.core import parallel_state

        if len(self.chunks) > 1:
            raise ValueError("MegatronTrainer trains without virtual pipeline stages only")
        dp_rank = parallel_state.get_data_parallel_rank()
        losses = []
        for _ in range(steps):
            generator = torch.Generator().manual_seed(10_000 + 97 * self.steps_done + dp_rank)
            ids = torch.randint(
                0, self.hf_config.vocab_size, (batch, seq_len + 1), generator=generator
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._forward_backward(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
            self._reduce_grads()
            self.optimizer.step()
            self.steps_done += 1
            if loss is not None:
                losses.append(float(loss))
        return losses

    def _forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """One micro-batch through the pipeline: activations forward, grads back, by hand."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        first, last = self.model.pre_process, self.model.post_process
        batch, seq_len = ids.shape
        positions = torch.arange(seq_len).unsqueeze(0).expand(batch, seq_len)
        inputs = None
        if not first:
            inputs = torch.empty(seq_len, batch, self.hf_config.hidden_size)
            dist.recv(inputs, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            inputs.requires_grad_(True)
            self.model.set_input_tensor(inputs)
        output = self.model(ids, positions, None, labels=labels if last else None)
        loss = None
        if last:
            loss = output.float().mean()
            loss.backward()
        else:
            next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
            dist.send(output.detach().contiguous(), dst=next_rank)
            grad = torch.empty_like(output)
            dist.recv(grad, src=next_rank)
            output.backward(grad)
        if inputs is not None:
            dist.send(
                inputs.grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank()
            )
        return None if loss is None else loss.detach()

    def _reduce_grads(self) -> None:
        """What Megatron's DDP and ``finalize_model_grads`` do, on gloo."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        expert_dp_group = parallel_state.get_expert_data_parallel_group()
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            # Replicated over TP, but each TP rank sees only its own heads' contribution.
            if ("q_layernorm" in name or "k_layernorm" in name) and tp_group.size() > 1:
                dist.all_reduce(param.grad, group=tp_group)
            group = expert_dp_group if ".experts." in name else dp_group
            if group.size() > 1:
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(group.size())
        if self.pp > 1 and self.model.share_embeddings_and_output_weights:
            weight = self.model.shared_embedding_or_output_weight()
            if weight is not None and weight.grad is not None:
                dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())

    def export(self) -> MegatronExport:
        """This rank's export (no collective)."""
        return MegatronExport(self.chunks, hf_config=self.config)

    def bridge_state(self) -> dict[str, torch.Tensor]:
        """Megatron-Bridge's export of the whole model (collective: every rank gets every HF
        tensor), cut to the HF vocab (Bridge exports the padded rows) and without the
        ``lm_head.weight`` clone it adds for tied embeddings."""
        shims.apply_bridge()
        from megatron.bridge import AutoBridge

        hf = build_hf_config(self.config)
        hf.architectures = [type(hf).__name__.replace("Config", "ForCausalLM")]
        bridge = AutoBridge.from_hf_config(hf)
        vocab = self.hf_config.vocab_size
        state = {}
        for name, tensor in bridge.export_hf_weights(self.chunks, cpu=True, show_progress=False):
            if name == "lm_head.weight" and self.hf_config.tie_word_embeddings:
                continue
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor = tensor[:vocab]
            state[name] = tensor.detach().clone()
        return state

    def close(self) -> None:
        """Destroy Megatron's parallel groups (the default group stays)."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def load_hf_state(
    model: torch.nn.Module | list[torch.nn.Module],
    state: dict[str, torch.Tensor],
    *,
    hf_config: Any,
) -> None:
    """Copy an HF checkpoint's tensors into this rank's parameters, each window from the box
    `weightsync.export.megatron.megatron_pieces` maps it to (padding rows are left as
    they are). No collective."""
    from weightsync.export.megatron import megatron_pieces

    vocab = int(_value(hf_config, "vocab_size"))
    tied = bool(_value(hf_config, "tie_word_embeddings"))
    with torch.no_grad():
        for piece in megatron_pieces(model, hf_vocab_size=vocab, tied=tied):
            source = state[piece.hf_name][tuple(slice(a, b) for a, b in piece.box)]
            piece.view().copy_(source)


def _value(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)
