"""The shims that let SGLang 0.5.23 run on this CPU (tests/sglang_cpu/stubs) do what they say
and no more: import-only stubs that raise when used, and two functions replaced."""

from __future__ import annotations

import subprocess

import pytest

from sglang_cpu.launch import STUBS_DIR, venv_if_built

pytestmark = pytest.mark.sglang

PROBE = """
import sgl_kernel, torchvision
from torchvision.transforms import InterpolationMode
try:
    sgl_kernel.silu_and_mul()
except RuntimeError as exc:
    print("sgl_kernel raises:", exc)
try:
    InterpolationMode.BICUBIC()()
except RuntimeError as exc:
    print("torchvision raises:", exc)
from sglang.srt.model_loader import remote_instance_weight_loader_utils as loader
from sglang.srt.utils import weight_checker_comparator as comparator
import torch
print("register is v1:", loader.register_memory_region is loader.register_memory_region_v1)
chunks = list(comparator.RawComparable(torch.arange(10.0)).iter_chunks())
print("chunks on", chunks[0][0].device)
"""


def test_stubs_raise_when_used_and_patches_apply() -> None:
    venv = venv_if_built()
    if venv is None:
        pytest.skip("real SGLang's venv is not built here: run scripts/setup --tests")
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(STUBS_DIR), "SGLANG_USE_CPU_ENGINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "sgl_kernel raises: sgl_kernel stub: silu_and_mul() was called" in out
    assert "torchvision raises: torchvision stub was called" in out
    assert "register is v1: True" in out
    assert "chunks on cpu" in out
