"""`weightsync push` in a process of its own whose checkpoint is truncated while it pushes.

Usage: ``python truncating_push.py TENSOR PUSH_ARGS...``. The push reads the checkpoint once
for its finite check and once more to write it; on the second read of tensor TENSOR the
file is cut in the middle of that tensor, just before the read (as a trainer rewriting the
checkpoint in place would). With a memory-mapped checkpoint this process would die of
SIGBUS; read with file reads, the push must fail with an error naming the file and tensor.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from weightsync.checkpoint import SafetensorsCheckpoint, SafetensorsEntry
from weightsync.cli.main import app


def main() -> None:
    tensor, push_args = sys.argv[1], sys.argv[2:]
    read_into = SafetensorsCheckpoint.read_into
    reads = 0

    def truncating_read_into(self: Any, entry: SafetensorsEntry, out: memoryview) -> None:
        nonlocal reads
        if entry.name == tensor:
            reads += 1
            if reads == 2:
                os.truncate(entry.file, entry.offset + entry.num_bytes // 2)
        read_into(self, entry, out)

    SafetensorsCheckpoint.read_into = truncating_read_into  # type: ignore[method-assign]
    app(["push", *push_args], prog_name="weightsync")


if __name__ == "__main__":
    main()
