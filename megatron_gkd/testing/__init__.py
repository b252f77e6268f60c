"""Helpers shared by tests and benchmarks: multi-process runs, tiny Megatron-Core models."""
