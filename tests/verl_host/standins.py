"""The stand-ins around verl 0.9.1's real checkpoint-engine objects in the verl tests.

verl's own code runs unmodified: ``CheckpointEngineManager`` (every update, the process-group
build, ``add_replicas`` / ``remove_replicas``, the pause / KV / resume wrappers),
``CheckpointEngineRegistry``, ``CheckpointEngineWorker`` (the rollout workers, created by
``RolloutReplica.init_standalone``), ``ActorRolloutRefWorker`` (``__init__``,
``update_weights``, ``execute_checkpoint_engine``), ``RayWorkerGroup`` and the resource pools.
What stands in for what verl cannot run on a CPU, or for SGLang:

- `TrainerEngine`: the training engine (verl's FSDP / Megatron engines need CUDA). A real
  transformers Qwen3 that takes real SGD steps; ``get_per_tensor_param`` has verl's
  contract (a generator of ``(hf_name, tensor)`` with full HF shapes, and a peft config):
  every tensor by default, as verl's engines export it, or with ``pp_local=True`` (patched
  verl) only this rank's pipeline stage, each actor rank being one stage;
- `ActorWorker`: verl's ``ActorRolloutRefWorker`` with ``init_model`` replaced: the engine
  above, then the checkpoint engine built as verl builds it (engine_workers.py:678-688,
  copied verbatim), and a few test methods (train, greedy tokens, what was exported);
- `ReferenceReplica`: a ``RolloutReplica`` whose servers are `ReferenceServerActor` actors
  fronting `weightsync serve` replicas (verl's are SGLang servers), and whose rollout
  workers get `ReferenceServerAdapter` (verl's is SGLang's ``ServerAdapter``);
and a Mooncake transport whose writes fail on demand (`weightsync.testing.transports`), for a
sender that fails mid-push.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import ray
import torch
from server_actor import ReferenceServerActor
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.distributed import initialize_global_process_group_ray
from verl.utils.import_utils import import_external_libs
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from weightsync.testing.reference import greedy_tokens
from weightsync.testing.transports import FailsAfter
from weightsync.transport import MooncakeConfig, MooncakeTransport


class TrainerEngine:
    """A tiny HF causal LM that trains; exports as verl's engines do (see module docstring)."""

    def __init__(self, checkpoint: str) -> None:
        from transformers import AutoModelForCausalLM

        self.module = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.5)
        self.pp_rank = torch.distributed.get_rank()
        self.pp_size = torch.distributed.get_world_size()
        self.exports: list[dict[str, Any]] = []

    def train_step(self, seed: int) -> None:
        # Every rank draws the same batch: the ranks stay equal, as data-parallel ranks do.
        vocab = self.module.config.vocab_size
        batch = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))
        self.optimizer.zero_grad()
        self.module(input_ids=batch, labels=batch).loss.backward()
        self.optimizer.step()

    def stage_of(self, name: str) -> int:
        """The pipeline stage that owns HF tensor `name` (layers split evenly)."""
        num_layers = self.module.config.num_hidden_layers
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            return layer * self.pp_size // num_layers
        return 0 if "embed_tokens" in name else self.pp_size - 1

    def get_per_tensor_param(self, pp_local: bool = False, **kwargs: Any):
        state = self.module.state_dict()
        names = [n for n in state if not pp_local or self.stage_of(n) == self.pp_rank]
        self.exports.append({"pp_local": pp_local, "names": names})
        return ((name, state[name].detach()) for name in names), None


class ActorWorker(ActorRolloutRefWorker):
    """verl's actor worker with the stand-in engine (see module docstring)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
        self.actor = SimpleNamespace(engine=TrainerEngine(os.environ["VERL_TEST_CHECKPOINT"]))

        # fmt: off
        # ---- verbatim from verl/workers/engine_workers.py:678-688 ("4. build checkpoint engine")
        if "actor" in self.role:
            checkpoint_engine_config = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine)  # noqa: E501
            backend = checkpoint_engine_config.backend
            bucket_size = checkpoint_engine_config.update_weights_bucket_megabytes << 20
            engine_kwargs = checkpoint_engine_config.engine_kwargs.get(backend, {})
            # If custom_backend_module is set, import it so plugins can register
            # in CheckpointEngineRegistry before the backend is instantiated.
            import_external_libs(checkpoint_engine_config.custom_backend_module or None)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                backend, is_master=(torch.distributed.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs  # noqa: E501
            )
        # ---- end verbatim
        # fmt: on

        self.failing = FailsAfter(
            MooncakeTransport(
                MooncakeConfig(hostname=ray.util.get_node_ip_address(), timeout_s=10)
            ),
            message="injected sender failure",
        )
        self.checkpoint_engine.use_transport(self.failing)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, seed: int) -> None:
        self.actor.engine.train_step(seed)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def greedy(self, prompts: tuple, max_new_tokens: int) -> list[list[int]]:
        return greedy_tokens(self.actor.engine.module, torch.float32, prompts, max_new_tokens)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exports(self) -> dict[str, Any]:
        engine = self.actor.engine
        return {
            "rank": engine.pp_rank,
            "exports": engine.exports,
            "stages": {n: engine.stage_of(n) for n in engine.module.state_dict()},
            "backend": type(self.checkpoint_engine).__module__
            + "."
            + type(self.checkpoint_engine).__name__,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_writes_after(self, num_writes: int | None) -> None:
        # Rank 0 only: one sender fails, the other finishes its share.
        if torch.distributed.get_rank() == 0:
            self.failing.remaining = num_writes


class ReferenceServerAdapter(BaseRollout):
    """The rollout adapter in each ``CheckpointEngineWorker`` (verl's is SGLang's
    ``ServerAdapter``): hands the replica what the backend received (nothing, here)."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        self.replica_rank = replica_rank
        self.received = 0

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, **kwargs):
        async for _ in weights:
            self.received += 1
        if self.received:
            raise RuntimeError(f"the rollout side received {self.received} tensors over verl")


class ReferenceReplica(RolloutReplica):
    """A ``RolloutReplica`` over a running `weightsync serve` (see module docstring)."""

    def __init__(self, *args, url: str, bootstrap_port: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.url = url
        self.bootstrap_port = bootstrap_port

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        adapter = ReferenceServerAdapter(
            config=self.config,
            model_config=self.model_config,
            device_mesh=None,
            replica_rank=self.replica_rank,
        )
        return RayClassWithInitArgs(
            cls=ray.remote(CheckpointEngineWorker),
            rollout_config=self.config,
            model_config=self.model_config,
            server_adapter=adapter,
        )

    async def launch_servers(self):
        server = (
            ray.remote(ReferenceServerActor)
            .options(name=f"reference_server_{self.replica_rank}_0")
            .remote(url=self.url, replica_rank=self.replica_rank)
        )
        self.servers = [server]
        host, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{host}:{port}"
        # What patched verl's RolloutReplica.engine_info_bootstrap_port reports.
        self._engine_info_bootstrap_port = self.bootstrap_port
