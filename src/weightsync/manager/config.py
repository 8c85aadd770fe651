"""Configuration of the control-plane side of a sync."""

from __future__ import annotations

from dataclasses import dataclass

_PAUSE_MODES = ("abort", "retract", "in_place")
_SELECTORS = ("target", "draft", "all")


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConfig:
    """How `SyncManager` drives the rollout replicas through an update.

    Attributes:
        api_key: sent as ``Authorization: Bearer`` to every replica, or None.
        check_weight_update_equal: snapshot and corrupt every replica's weights before the
            first sync, and require the first sync to restore them bit-exactly.
        allow_quant_error: let the bit-exact check accept one quantised-dtype ULP.
        pause_mode: how in-flight requests are paused (``abort``, ``retract``, ``in_place``).
        selector: which weights a session updates (``target``, ``draft``, ``all``).
        release_kv_cache: release the KV cache during the update and resume it after.
        http_timeout_s: per-request timeout of control-plane calls.
        check_timeout_s: timeout of the weights checker's calls (they touch every parameter).
    """

    api_key: str | None = None
    check_weight_update_equal: bool = False
    allow_quant_error: bool = False
    pause_mode: str = "abort"
    selector: str = "target"
    release_kv_cache: bool = True
    http_timeout_s: float = 60.0
    check_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.pause_mode not in _PAUSE_MODES:
            raise ValueError(
                f"SyncConfig.pause_mode={self.pause_mode!r}: choose one of {_PAUSE_MODES}"
            )
        if self.selector not in _SELECTORS:
            raise ValueError(f"SyncConfig.selector={self.selector!r}: choose one of {_SELECTORS}")
        for name in ("http_timeout_s", "check_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SyncConfig.{name} must be positive, got {getattr(self, name)}")
