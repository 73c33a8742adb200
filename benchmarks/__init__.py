"""Benchmarks of the llumdask serving stack; run each as ``python -m benchmarks.NAME``."""
