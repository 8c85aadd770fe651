"""The broadcast baseline: weight sync the way verl's and slime's NCCL engines do it.

Trainer rank 0 gathers the full HF tensors, packs them into flat buckets and broadcasts each
over a torch.distributed group it shares with every rollout rank (gloo on CPU, NCCL on GPU);
each rollout rank receives every bucket whole and loads it tensor by tensor. It exists to be
measured against the point-to-point sync (``bench/sync.py``), over the same lifecycle.

`TensorSync` is the colocated baseline (verl's ``naive`` backend): the same buckets shared
by reference in SGLang's ``update_weights_from_tensor`` instead of broadcast.
"""

from weightsync.baseline.trainer.buckets import BroadcastBucket, plan_buckets
from weightsync.baseline.trainer.config import BroadcastConfig
from weightsync.baseline.trainer.group import BroadcastGroup
from weightsync.baseline.trainer.sync import BroadcastSync
from weightsync.baseline.trainer.tensor_sync import TensorSync

__all__ = [
    "BroadcastBucket",
    "BroadcastConfig",
    "BroadcastGroup",
    "BroadcastSync",
    "TensorSync",
    "plan_buckets",
]
