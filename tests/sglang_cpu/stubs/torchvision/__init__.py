# Import-only stand-in for torchvision: every PyPI torchvision wheel needs a CUDA torch
# (libc10_cuda.so), and SGLang imports it at module load in multimodal code a text model never
# runs (first: configs/nano_nemotron_vl.py -> multimodal/internvl_utils.py). Any torchvision.*
# submodule imports; any name in it is a class that can be referenced, subclassed and built, and
# raises if an instance is called.
import importlib.machinery
import sys
import types

# transformers reads it (is_torchvision_greater_or_equal); 0.28 is torch 2.13's torchvision.
__version__ = "0.28.0"


class _AnyMeta(type):
    def __getattr__(cls, name):  # InterpolationMode.BICUBIC and the like
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Any(metaclass=_AnyMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision stub was called")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any


class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, _Finder, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    @staticmethod
    def exec_module(module):
        pass


sys.meta_path.insert(0, _Finder)
sys.modules[__name__].__class__ = _Module
