"""Engines behind the Engine contract: sim (latency model) and vllm (real vLLM)."""
