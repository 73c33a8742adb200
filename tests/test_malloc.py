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


def _glibc_with_mallinfo2() -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(part) for part in version.split(".")[:2]) >= (2, 33)


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc 2.33 or later (mallinfo2) only")
def test_a_megabyte_comes_from_the_heap_after_the_settings_despite_a_nanny_environment():
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}  # what a Dask nanny sets
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    before, applied, after = out.split()
    assert before == "1"  # the environment alone: the megabyte is an mmap
    assert applied == "True" and after == "0"


def test_without_glibc_nothing_is_set(monkeypatch):
    import ctypes

    from llumdask.engine.vllm import malloc

    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a C library without glibc's symbols
    malloc.keep_freed_memory_for_reuse.cache_clear()
    try:
        assert malloc.keep_freed_memory_for_reuse() is False
    finally:
        malloc.keep_freed_memory_for_reuse.cache_clear()
