# Python imports this at start-up in every process of the SGLang server (this folder is on its
# PYTHONPATH): the launcher, its scheduler and detokenizer processes. It replaces two SGLang
# 0.5.23 functions that assume CUDA. Each is swapped right after its module executes, through an
# import hook, because other modules bind the names with `from ... import` when they load, and
# importing SGLang here would load torch into every process, helpers included.
import importlib.abc
import importlib.util
import sys


def _register_v1(module):
    # register_memory_region() calls register_memory_region_v2 whenever torch is importable; v2
    # reads torch.cuda.memory.memory_snapshot(), which a CPU torch lacks (AttributeError at the
    # transfer-engine registration the seed flag triggers). v1 registers each parameter with the
    # TransferEngine one by one and returns the same {name: (ptr, numel, element_size)}.
    module.register_memory_region = module.register_memory_region_v1


def _compare_in_place(module):
    # RawComparable.iter_chunks moves every chunk to CUDA (`.cuda()`), so /weights_checker
    # compare fails on a CPU torch ("Torch not compiled with CUDA enabled"). Compare in place.
    def iter_chunks(self):
        flat = self.tensor.reshape(-1)
        for start in range(0, flat.numel(), module.CHUNK_NUMEL):
            yield flat[start : start + module.CHUNK_NUMEL], None

    module.RawComparable.iter_chunks = iter_chunks


_PATCHES = {
    "sglang.srt.model_loader.remote_instance_weight_loader_utils": _register_v1,
    "sglang.srt.utils.weight_checker_comparator": _compare_in_place,
}


class _PatchAfterExec(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        patch = _PATCHES.pop(name, None)  # popped: the lookup below skips this finder
        if patch is None:
            return None
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchAfterExec())
