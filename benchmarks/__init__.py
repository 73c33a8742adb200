"""Benchmarks of the llumdask serving stack; run each as ``python -m llumdask.benchmarks.NAME``."""
