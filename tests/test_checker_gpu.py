"""The weights checker on a real GPU: a snapshot that fits with room to spare stays on the
GPU; on a GPU that another process (here: a filler tensor) has nearly filled, it goes to host
memory, says so, and ``reset_tensors`` and ``compare`` still work with what is left."""

from __future__ import annotations

import pytest
import torch

from weightsync.receiver.checker import WeightsChecker, device_free_memory, gpu_headroom_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GIB = 1 << 30


def _params(device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    return {
        # 1 GiB in one parameter: an embedding's size, many chunks of the compare.
        "embed.weight": torch.randn(GIB // 2, dtype=torch.bfloat16, device=device).view(
            1 << 16, -1
        ),
        "norm.weight": torch.rand(4096, generator=generator, device=device),
    }


def test_a_snapshot_stays_on_the_gpu_only_with_room_to_spare():
    device = torch.device("cuda", torch.cuda.current_device())
    params = _params(device)
    saved = {name: t.cpu() for name, t in params.items()}
    checker = WeightsChecker(params)

    taken = checker.run("snapshot")
    assert taken.details == {"snapshot_memory": {str(device): "gpu"}}, taken.message
    assert f"taken in GPU memory for {device}" in taken.message
    params["embed.weight"].view(-1)[123_456_789] += 1
    report = checker.run("compare")
    assert not report.success
    assert report.details["differing"]["embed.weight"]["num_different"] == 1

    # Fill the GPU until a copy of the parameters would eat into the headroom: the snapshot
    # goes to host memory, and the GPU keeps what it had free.
    free, total = device_free_memory(device)
    need = sum(t.numel() * t.element_size() for t in params.values())
    filler = torch.empty(
        free - gpu_headroom_bytes(total) - need // 2, dtype=torch.uint8, device=device
    )
    try:
        before, _ = torch.cuda.mem_get_info(device)
        taken = checker.run("snapshot")
        assert taken.details == {"snapshot_memory": {str(device): "host"}}, taken.message
        assert f"taken in host memory for {device} (no room on the GPU:" in taken.message
        assert "kept free" in taken.message
        assert torch.cuda.mem_get_info(device)[0] >= before - (64 << 20)
        # What failed in the issue: reset_tensors right after the snapshot.
        assert checker.run("reset_tensors", seed=1).success
        assert not checker.run("compare").success
        checker.run("snapshot")
        for name, tensor in params.items():
            tensor.copy_(saved[name].to(device))
        checker.run("reset_tensors", seed=2)
        for name, tensor in params.items():
            tensor.copy_(saved[name].to(device))
        # The snapshot was taken after the reset of seed 1: restoring the saved values is a
        # change it must report, parameter by parameter.
        report = checker.run("compare")
        assert set(report.details["differing"]) == set(params)
        checker.run("snapshot")
        equal = checker.run("compare")
        assert equal.success, equal.message
    finally:
        del filler
        torch.cuda.empty_cache()
