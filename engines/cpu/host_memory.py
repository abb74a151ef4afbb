"""Keep freed host memory in the process, so large CPU tensors stop costing page faults.

glibc returns a large freed block to the kernel at once: blocks above its mmap threshold (128 KB,
rising with use up to 32 MB) are unmapped, and the top of the heap is trimmed. The next tensor of
that size then takes a page fault per 4 KB page, and the kernel zeroes each page first. A training
step of the default recipe allocates and frees ~100 MB of activations and gradients that way: it
measured 15,000-66,000 minor faults per step (~60-260 MB touched afresh) and ~0 with this setting,
for 10-20% of the step's time on two CPU cores. Serving is alike: a SmolLM2 fp32 replica took ~26,000 faults
a 15-prompt prefill step (~5,500 with this setting), and its 2,048-token steps of the 64-stream HTTP mix ran
2.92 / 2.85 s against 3.00 / 3.16 s without it (TTFT p90 11.7 / 11.8 s against 12.5 / 13.1 s; 2-core EPYC VM,
where a fresh page costs ~5 us). PyTorch's CUDA allocator caches blocks for the same reason; on the CPU it relies
on malloc. The training loop and every CPU ModelRunner call it.

`retain_freed_memory()` raises glibc's thresholds (mallopt) so freed blocks are reused: the process
keeps its peak heap instead of giving it back between steps. A no-op elsewhere than glibc.

`huge_page_copy(t)` puts a large tensor that is streamed over and over (an inference weight) in
memory backed by 2 MB pages; `huge_page_zeros(n)` gives such memory untouched (the paged KV cache);
`populate(t, start, nbytes)` maps a range of such memory ahead of its first write, contents unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit: blocks above it are still mmapped
_done: bool | None = None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library (for mallopt and madvise), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Tell glibc to keep freed memory for reuse; True if it took effect (idempotent)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
                 and mallopt(_M_TRIM_THRESHOLD, 2**30) and mallopt(_M_TOP_PAD, 64 * 2**20))
    return _done


def give_back_freed_memory() -> None:
    """Return the heap's freed pages to the OS now (glibc's malloc_trim; a no-op elsewhere): once, after a load
    whose temporaries are gone, whatever retain_freed_memory asked glibc to keep between steps."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


HUGE_PAGE = 2 * 2**20
"""Bytes of a transparent huge page on x86-64 and most aarch64 kernels."""


def huge_page_zeros(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of zeros (uint8) in memory the kernel is asked to back with 2 MB pages (anonymous mmap,
    2 MB-aligned, madvise(MADV_HUGEPAGE)), untouched: a page is mapped (and zeroed) on its first write, 2 MB at a
    time. None where that is not available (not Linux, under 2 MB) or when madvise is refused."""
    import mmap

    import torch

    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # private (a shared anonymous map is shmem, whose huge pages are off by default); untouched pages:
    # advised before the first write
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        mm.close()
        return None
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as the tensor lives
    off = (-raw.data_ptr()) % HUGE_PAGE
    return raw[off:off + nbytes]


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in 2 MB pages (huge_page_zeros); the tensor itself where those are not available.

    Why: a decode step streams every weight once (~0.5 GB for GPT-2-124M in fp32), one 4 KB page
    after another, and each page costs a TLB miss and a page walk; where transparent huge pages are
    on "madvise" (the default of many distributions, this machine's included) nothing is backed
    by 2 MB pages unless asked. Measured on the 2-core EPYC of BENCHMARKS.md (issue 12): a decode
    step's panel-kernel Linears 15.8-17.0 ms from huge pages against 16.9-19.0 ms from 4 KB pages."""
    raw = huge_page_zeros(t.numel() * t.element_size())
    if raw is None:
        return t
    out = raw.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, as a write would, without changing their contents
_madvise = None  # libc's madvise once loaded; False where populate cannot work here


def populate(t: torch.Tensor, start: int, nbytes: int) -> bool:
    """Map bytes [start, start + nbytes) of CPU tensor t's storage ahead of their first write (madvise
    MADV_POPULATE_WRITE over the pages they touch): a page already mapped is left as it is, a new one is
    zeroed, as a first write would have it, so this may run while other threads write the tensor. Why:
    the first write to a page of the untouched KV cache costs a fault (a 2 MB page zeroed; in a VM also
    the host's own faults): on the 2-core EPYC VM of BENCHMARKS.md, ~1.2 s a GiB, so a burst's first
    steps on fresh blocks ran ~13 % slower than on the same blocks again. False where this kernel or
    platform cannot (then nothing was done, and it is not worth asking again)."""
    global _madvise
    if _madvise is None:
        _madvise = getattr(_libc(), "madvise", None) if sys.platform.startswith("linux") else None
        if _madvise is None:
            _madvise = False
        else:
            _madvise.argtypes, _madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    if _madvise is False or nbytes <= 0:
        return False
    page = 4096
    lo = (t.data_ptr() + start) // page * page
    hi = -(-(t.data_ptr() + start + nbytes) // page) * page
    if _madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:  # EINVAL before Linux 5.14; ENOMEM: no memory for it
        _madvise = False
        return False
    return True
