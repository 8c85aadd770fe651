"""The trainer side of a modelled cluster: which GPU holds which HF tensor.

A trainer of ``num_gpus = pp * dp * tp * ep`` GPUs: `pp` pipeline stages (contiguous
layers, `stage_layers`), each held by `dp` data-parallel copies, each copy spread over
``tp * ep`` GPUs of its model-parallel group. GPU rank ``((dp_index * pp) + stage) * mp +
slot`` with ``mp = tp * ep``, so a model-parallel group fills consecutive GPUs (a node at
``mp = 8``).

Inside a group the stage's tensors are dealt whole to the slots, largest first onto the
slot with the fewest bytes: each GPU holds about ``1 / mp`` of its stage, as a TP/EP
trainer does after gathering its shards tensor by tensor, and every data-parallel copy of
a slot holds the same tensors, so any of them may send them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.plan import stage_layers
from weightsync.predict.traffic import TrafficUnit


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerShape:
    """How the trainer's GPUs split the model.

    Attributes:
        num_gpus: trainer GPUs; ``pp * tp * ep`` divides it, the quotient is the DP size.
        tp: tensor-parallel size inside a stage.
        ep: expert-parallel size inside a stage (on top of `tp`).
        pp: pipeline stages.

    Raises:
        ValueError: a size below 1 or a GPU count that ``pp * tp * ep`` does not divide.
    """

    num_gpus: int
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("num_gpus", "tp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainerShape.{name} must be an int >= 1, got {value!r}")
        if self.num_gpus % (self.pp * self.tp * self.ep):
            raise ValueError(
                f"TrainerShape: {self.num_gpus} GPUs do not split into pp={self.pp} x "
                f"tp={self.tp} x ep={self.ep}; use a multiple of {self.pp * self.tp * self.ep}"
            )

    @property
    def mp(self) -> int:
        """GPUs of one model-parallel group (``tp * ep``)."""
        return self.tp * self.ep

    @property
    def dp(self) -> int:
        """Data-parallel copies of every stage."""
        return self.num_gpus // (self.pp * self.mp)

    def rank(self, *, dp_index: int, stage: int, slot: int) -> int:
        """The GPU rank of `slot` of `stage` in data-parallel copy `dp_index`."""
        return (dp_index * self.pp + stage) * self.mp + slot


def simulated_holders(
    units: Sequence[TrafficUnit], shape: TrainerShape
) -> dict[str, tuple[int, ...]]:
    """``{hf_name: ranks of the trainer GPUs that hold it}``, sorted ranks.

    Tensors before the layers (embeddings) sit on the first stage, after them (final norm,
    output layer) on the last.

    Raises:
        ValueError: more stages than the units' layers.
    """
    num_layers = max((u.layer for u in units), default=0)
    if shape.pp > max(num_layers, 1):
        raise ValueError(f"pp={shape.pp} stages exceed the model's {num_layers} layers")
    stages = stage_layers(max(num_layers, 1), shape.pp)
    stage_of = {layer: s for s, block in enumerate(stages) for layer in block}
    sizes: dict[str, int] = defaultdict(int)
    first_seen: dict[str, int] = {}
    layer_of: dict[str, int] = {}
    for index, unit in enumerate(units):
        name = unit.key[0]
        sizes[name] += unit.num_bytes
        first_seen.setdefault(name, index)
        layer_of[name] = unit.layer
    by_stage: dict[int, list[str]] = defaultdict(list)
    for name, layer in layer_of.items():
        stage = 0 if layer < 0 else stage_of.get(layer, shape.pp - 1)
        by_stage[stage].append(name)
    holders: dict[str, tuple[int, ...]] = {}
    for stage, names in by_stage.items():
        load = [0] * shape.mp
        copies = [
            tuple(shape.rank(dp_index=d, stage=stage, slot=slot) for d in range(shape.dp))
            for slot in range(shape.mp)
        ]
        for name in sorted(names, key=lambda n: (-sizes[n], first_seen[n])):
            slot = min(range(shape.mp), key=lambda k: (load[k], k))
            load[slot] += sizes[name]
            holders[name] = copies[slot]
    return holders
