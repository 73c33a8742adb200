"""How PyTorch obtains page-locked host memory in a process that moves KV stages off a GPU.

Stages travel through page-locked memory from PyTorch's caching host allocator
(`llumdask.engine.cuda_staging`), which asks the driver for a new block the first time a stage of
a new size class comes. By default that is a `cudaHostAlloc`, and while it runs every other CUDA
call of the process waits: a request decoding on the source paused 111 ms between two tokens
(40 ms normally) in a first migration of 8,192 tokens on an H200. With
`pinned_use_cuda_host_register` PyTorch page-locks ordinary memory with `cudaHostRegister` from
several threads, which holds the process far less (49 ms in the same run; benchmarks/README.md,
"Page-locked memory registered in place"). Blocks once cached are reused either way.

The setting is process-wide and read when PyTorch first initialises its CUDA allocators, so an
engine applies it before it touches the device; a setting the user made is kept. Sim engines with
their KV on a GPU apply it; the vLLM engine does not yet: vLLM's GPU runner maps some of its own
page-locked buffers into the device's address space, which registered memory has not been shown
to allow here (no vLLM has run on a GPU in these tests), so vLLM users opt in through
`PYTORCH_CUDA_ALLOC_CONF` (README, "Running a real model on GPUs").
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# PyTorch's allocator settings: PYTORCH_ALLOC_CONF where set (the current name), else the CUDA one.
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
REGISTER_IN_PLACE = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def register_in_place(environ: MutableMapping[str, str] = os.environ) -> str:
    """Make PyTorch page-lock host memory in place (`REGISTER_IN_PLACE`) unless its settings
    already say how; returns the variable that holds the settings."""
    name = next((v for v in ALLOC_CONF_VARIABLES if environ.get(v)), ALLOC_CONF_VARIABLES[1])
    current = environ.get(name, "")
    if "pinned_use_cuda_host_register" not in current:
        environ[name] = f"{current},{REGISTER_IN_PLACE}" if current else REGISTER_IN_PLACE
    return name
