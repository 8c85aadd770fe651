"""``python -m weightsync.integrations.verl.patches {apply,check,path} [--root DIR]``.

``apply`` patches the verl under ``--root`` (default: the installed one), ``check`` exits 0
when it carries the patch and 1 otherwise, ``path`` prints where the patch file is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from weightsync.integrations.verl.patches import (
    PATCH_FILE,
    apply_patch,
    installed_verl_root,
    is_patched,
)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m weightsync.integrations.verl.patches")
    parser.add_argument("command", choices=("apply", "check", "path"))
    parser.add_argument("--root", type=Path, help="the site-packages folder that holds verl")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(PATCH_FILE)
        return 0
    try:
        root = args.root if args.root is not None else installed_verl_root()
        if args.command == "check":
            patched = is_patched(root)
            print(f"{root}/verl: {'patched' if patched else 'not patched'}")
            return 0 if patched else 1
        applied = apply_patch(root)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{root}/verl: {'patched' if applied else 'already patched'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
