"""The vLLM engine's malloc settings: a megabyte allocation comes from the heap, not an mmap,
even in a process started the way a Dask nanny starts its workers."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes
from llumdask.engine.vllm.malloc import keep_freed_memory_for_reuse

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.mallinfo2.restype = Mallinfo2

def mmapped_while_holding_a_megabyte():
    block = libc.malloc(1 << 20)
    holding = libc.mallinfo2().hblks
    libc.free(ctypes.c_void_p(block))
    return holding - libc.mallinfo2().hblks

print(mmapped_while_holding_a_megabyte(), keep_freed_memory_for_reuse(), mmapped_while_holding_a_megabyte())
"""


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_a_megabyte_comes_from_the_heap_after_the_settings_despite_a_nanny_environment():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}  # what a Dask nanny sets
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    before, applied, after = out.split()
    assert before == "1"  # the environment alone: the megabyte is an mmap
    assert applied == "True" and after == "0"
