"""A vLLM worker extension for the tests (``--worker-extension-cls
vllm_cpu.probe_extension.ProbeExtension``, with tests/ on the server's PYTHONPATH): its methods
are added to every worker and called through ``/collective_rpc``.

It shows what the tests need to know of a running worker: which weightsync it imports (the
checkout's, put first on the server's PYTHONPATH by `launch.server_env`) and what its parameters
look like once vLLM has loaded and post-processed them.
"""

from __future__ import annotations

from typing import Any


class ProbeExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def probe_weightsync_path(self) -> str:
        """Where the worker imports weightsync from."""
        import weightsync

        return str(weightsync.__file__)

    def probe_parameters(self) -> list[list[Any]]:
        """Every parameter of the rank's model: ``[name, shape, dtype]`` in vLLM's order."""
        model = self.model_runner.model
        return [
            [name, list(param.shape), str(param.dtype).removeprefix("torch.")]
            for name, param in model.named_parameters()
        ]
