"""Memory the engine has read once and will not read again: a model's fp32 weights once the
adapter runs its own low-bit copy of them. Hugging Face maps a safetensors checkpoint's tensors
straight from the file, so those weights cost memory only where they were read; reading them
once (to check a GGUF's blocks against them) makes the whole file resident. `page_out` asks
the kernel to reclaim such pages (Linux's MADV_PAGEOUT): a clean page of the file is dropped
and read back from the file if anything touches it again, a page the program wrote is left
where it is, so the tensor's values never change. Elsewhere it does nothing."""

from __future__ import annotations

import ctypes
import mmap
import sys

MADV_PAGEOUT = 21  # Linux 5.4+


def page_out(tensors) -> int:
    """Advise the kernel to reclaim the whole pages of each (contiguous CPU) tensor; the bytes
    advised (0 where the platform cannot)."""
    if not sys.platform.startswith("linux"):
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # libc's, from the process's own symbols
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    advised = 0
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            continue
        start, size = t.data_ptr(), t.numel() * t.element_size()
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor only
        last = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and madvise(first, last - first, MADV_PAGEOUT) == 0:
            advised += last - first
    return advised
