"""The upstream change weightsync proposes to verl, carried as a patch against verl 0.9.1.

``verl-0.9.1.patch`` (five files of ``verl/``) adds the P2P lifecycle that stock verl lacks:

- ``CheckpointEngineManagerHook`` (``verl/checkpoint_engine/base.py``): a backend's
  driver-side companion (``CheckpointEngine.create_manager_hook``), told the manager's
  replicas (with ``server_address`` and ``engine_info_bootstrap_port``) when the manager is
  created and on every ``add_replicas`` / ``remove_replicas``, and called around every
  update: ``begin_update`` after generation is paused and the KV cache released,
  ``end_update`` exactly once afterwards, also when the update failed. ``update_weights``
  runs in a try/finally: the KV cache is always resumed, and generation on every replica
  except those ``end_update`` says hold partly written weights (the manager leaves those
  paused and logs which);
- ``CheckpointEngine.export_mode = "pp_local"`` (``verl/workers/engine_workers.py``): the
  actor hands ``send_weights`` ``get_per_tensor_param(pp_local=True)``, each rank's own
  pipeline stage (Megatron: ``verl/workers/engine/megatron/transformer_impl.py``; the FSDP
  engines export their full model, which is their stage);
- SGLang (``async_sglang_server.py``, ``replica.py``): with
  ``remote_instance_weight_loader_start_seed_via_transfer_engine`` each replica's first node
  picks a free engine-info bootstrap port unless one is configured (verl's one
  ``engine_kwargs.sglang`` dict otherwise gives every replica of a node the same port, and
  SGLang refuses the second), the memory saver defaults to off, the bootstrap server binds
  the node's address, and ``RolloutReplica.engine_info_bootstrap_port`` says the port.

Apply it to an installed verl with ``python -m weightsync.integrations.verl.patches apply``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

PATCH_FILE = Path(__file__).with_name("verl-0.9.1.patch")
VERL_VERSION = "0.9.1"
MARKER = "class CheckpointEngineManagerHook"


def installed_verl_root() -> Path:
    """The folder that holds the installed ``verl`` package (its site-packages).

    Raises:
        ValueError: verl is not installed in this environment.
    """
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ValueError("verl is not installed here: pip install 'weightsync[verl]'")
    return Path(spec.origin).parent.parent


def is_patched(root: Path) -> bool:
    """Whether the ``verl`` package under `root` carries the patch."""
    base = root / "verl" / "checkpoint_engine" / "base.py"
    return base.is_file() and MARKER in base.read_text()


def apply_patch(root: Path, *, dry_run: bool = False) -> bool:
    """Apply the patch to the ``verl`` package under `root` (a site-packages folder).

    Returns:
        True if it was applied now, False if `root` already carried it.

    Raises:
        ValueError: no verl under `root`, neither ``patch`` nor ``git`` is installed, or the
            patch does not apply (another verl version, or local edits); nothing is changed
            then.
    """
    if not (root / "verl" / "checkpoint_engine" / "base.py").is_file():
        raise ValueError(f"no verl package under {root}")
    if is_patched(root):
        return False
    if shutil.which("patch"):
        check = ["patch", "-p1", "--forward", "--batch", "--dry-run", "-i", str(PATCH_FILE)]
        run = [c for c in check if c != "--dry-run"] + ["--no-backup-if-mismatch"]
    elif shutil.which("git"):
        check = ["git", "apply", "--check", "-p1", str(PATCH_FILE)]
        run = ["git", "apply", "-p1", str(PATCH_FILE)]
    else:
        raise ValueError("applying the verl patch needs `patch` or `git` on PATH")
    probe = subprocess.run(check, cwd=root, capture_output=True, text=True)
    if probe.returncode != 0:
        raise ValueError(
            f"the weightsync patch for verl {VERL_VERSION} does not apply to {root}/verl "
            f"(another verl version, or local edits): {(probe.stdout + probe.stderr).strip()}"
        )
    if dry_run:
        return True
    done = subprocess.run(run, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"patching {root}/verl failed: {(done.stdout + done.stderr).strip()}")
    return True
