"""Presets, random checkpoints, seeded synthetic weights and the replica launcher, for the
demo, the benchmarks and the tests (the library itself never imports this package)."""
