"""glibc's heap for a training process: large blocks served from the heap, and kept there when freed.

glibc maps each block above its mmap threshold straight from the kernel and unmaps it when it is freed. The
threshold adapts to freed blocks, but never above 32 MB, so every tensor larger than that (an MLP activation
of a large micro-batch, the logits of a response, a 49k-entry embedding's gradient) is faulted in page by
page each time it is allocated, which in a training loop is every micro-batch. :func:`keep_freed_memory`
raises the threshold to 1 GB and stops the heap's top from being handed back, so that after the first steps
the process reuses its own pages. The cost is resident memory that stays at the run's high-water mark, and a
higher peak where freed blocks fall a few bytes short of the next request and the heap grows instead: 1.01x
for SmolLM2's PPO step, 1.34x for a random 25M model's with 64-row micro-batches (``bench/RESULTS.md``).

A process under another C allocator (a preloaded tcmalloc, say) allocates through that one instead, and
glibc's settings change nothing there.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GB come from the heap
TRIM_THRESHOLD = 2**31 - 1  # the largest free top of the heap that is kept (mallopt takes an int)

_kept = False


def glibc() -> bool:
    """Whether this process runs on glibc (whose ``mallopt`` these settings are for)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):
        return False


def configure(keep: bool) -> None:
    """``trainer.keep_freed_memory``: keep glibc's freed memory for reuse where ``keep``; glibc's defaults (and
    whatever an earlier call set: the settings are process-wide and not undone) otherwise."""
    if keep:
        keep_freed_memory()


def keep_freed_memory() -> bool:
    """Serve blocks up to 1 GB from glibc's heap and keep freed memory for reuse; once per process.

    Returns whether the settings are in force: False off glibc, or where glibc refused them.
    """
    global _kept
    if _kept:
        return True
    if not glibc():
        return False
    libc = ctypes.CDLL("libc.so.6")
    _kept = (libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD)) == 1
             and libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD)) == 1)
    return _kept
