# Import-only stand-in for sgl-kernel: its PyPI wheels (sgl-kernel, sglang-kernel) are CUDA builds,
# and SGLang's CPU path imports names from it at module load (e.g. mem_cache/memory_pool.py via
# kernels/ops/kvcache/cache_move.py). Every name is a function that raises if called. Submodules
# stay missing (ImportError), so SGLang's `try: from sgl_kernel.x import ...` fallbacks apply.
# Without AMX (and with this stub even with AMX: torch.ops.sgl_kernel has no
# convert_weight_packed), cpu_has_amx_support() is False and SGLang never calls these.
__version__ = "0.0.0"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel stub: {name}() was called")

    op.__name__ = name
    return op
