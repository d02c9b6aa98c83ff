"""Host memory: what a step frees stays with the process for the next step.

Every prefill step allocates activations of tens of MiB per layer and frees
them before the next layer (the bench model at 2,000 prompt tokens: four
24 MiB tensors in each MLP). glibc's malloc serves blocks above its mmap
threshold with fresh mappings, and gives the free top of a heap back to the
kernel once it passes the trim threshold; either way the next step faults the
same memory in again, one 4 KiB page at a time. Measured on the 2-core bench
VM: ~70,000 faults and 8-12% of a 2,000-token prefill step, against none
once freed memory is kept (``docs/benchmarks/compare.md``).

:func:`keep_freed_memory` raises both thresholds with ``mallopt``: the mmap
threshold to the most glibc allows (32 MiB; larger blocks are still mapped
and unmapped), the trim threshold to :data:`TRIM_THRESHOLD_BYTES`. Resident
memory then stays at the largest step's high-water mark, which the process
needs again at its next step of that size anyway. It leaves malloc alone where
the process already chose: any of glibc's ``MALLOC_*_`` tunables in the
environment (or ``glibc.malloc`` ones in ``GLIBC_TUNABLES``), or another
allocator preloaded (tcmalloc, jemalloc).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ceiling for the mmap threshold on 64-bit hosts (half its 64 MiB heap size)."""
TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of a heap kept before any is given back."""
TOP_PAD_BYTES = 64 << 20
"""Extra asked of the kernel each time a heap grows (address space only until touched)."""

_USER_CHOICES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep freed memory for reuse; True when it did (idempotent).

    False, changing nothing, off glibc, when the environment sets one of
    glibc's own malloc tunables (``MALLOC_*_``, ``GLIBC_TUNABLES``), or when
    ``LD_PRELOAD`` brings another allocator."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if (
        any(name in os.environ for name in _USER_CHOICES)
        or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
        or "malloc" in os.environ.get("LD_PRELOAD", "")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = all(
        mallopt(param, value)
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    if not done:
        log.warning("mallopt refused a setting; freed host memory may be returned to the kernel at every step")
    return done
