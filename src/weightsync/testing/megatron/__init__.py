"""Megatron-core on a CPU, for tests and the demo: the shims it needs and a tiny trainer.

Megatron-core and Megatron-Bridge are test dependencies installed by ``scripts/setup --tests``
(``megatron-core==0.19.2``; Megatron-Bridge, the tests' oracle, without its dependencies);
nothing in the library imports them.
"""
