"""Engine-owned parameters: what a rollout rank publishes that no HF tensor feeds.

SGLang registers some parameters whose values it computes itself rather than loading them
from the checkpoint: with an FP8 checkpoint every attention layer's ``k_scale`` and
``v_scale`` (float32 scalars of its FP8 KV cache, ``BaseKVCacheMethod``, which its own
weights checker skips). They are in a rank's ``weights_info`` like any weight. The plan
leaves them alone and names them in its report (`SyncPlan.engine_owned`) instead of
refusing them as unexpected; any other published parameter the layout does not know is
still refused, unless the caller declares it engine-owned too (`build_plan`'s
``engine_owned``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from weightsync.plan.items import LayoutGroup


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOwnedKind:
    """One declared kind of engine-owned parameter.

    Attributes:
        kind: its name in reports.
        patterns: shell patterns (``fnmatch``) of the parameter names.
        max_numel: the most elements one may have (a scale is a scalar), None for any; a
            larger parameter of a matching name is refused as unexpected.
    """

    kind: str
    patterns: tuple[str, ...]
    max_numel: int | None = None

    def matches(self, name: str, numel: int) -> bool:
        """Whether parameter `name` of `numel` elements is of this kind."""
        if self.max_numel is not None and numel > self.max_numel:
            return False
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


# The kinds every plan knows.
FP8_KV_SCALES = EngineOwnedKind(
    kind="fp8_kv_scale", patterns=("*.k_scale", "*.v_scale"), max_numel=1
)
ENGINE_OWNED_KINDS: tuple[EngineOwnedKind, ...] = (FP8_KV_SCALES,)
DECLARED = "declared"


@dataclass(frozen=True, slots=True)
class EngineOwned:
    """Which published parameters the plan leaves alone: the built-in kinds and the
    patterns a caller declares (kind `DECLARED`).

    Args:
        declared: shell patterns of further engine-owned parameter names.
    """

    declared: tuple[str, ...] = ()

    @classmethod
    def of(cls, patterns: Collection[str]) -> EngineOwned:
        """An `EngineOwned` with `patterns` declared."""
        return cls(declared=tuple(patterns))

    def kind_of(self, name: str, numel: int) -> str | None:
        """The kind of engine-owned parameter `name` is, or None when it is not one."""
        for kind in ENGINE_OWNED_KINDS:
            if kind.matches(name, numel):
                return kind.kind
        if any(re.fullmatch(fnmatch.translate(p), name) for p in self.declared):
            return DECLARED
        return None

    def of_groups(self, groups: Iterable[LayoutGroup]) -> dict[tuple[str, int], dict[str, str]]:
        """``{(replica, rank): {param_name: kind}}`` of every target's published parameters
        that its layout does not have and that are engine-owned (targets with none left
        out), names in published order."""
        found: dict[tuple[str, int], dict[str, str]] = {}
        for group in groups:
            known = {param.name for param in group.params}
            for target in group.targets:
                owned = {
                    name: kind
                    for name, (_, numel, _) in target.weights_info.items()
                    if name not in known and (kind := self.kind_of(name, numel)) is not None
                }
                if owned:
                    found[(target.replica, target.rank)] = owned
        return found
