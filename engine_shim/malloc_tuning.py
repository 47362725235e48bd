"""glibc malloc settings for a process that moves KV in large messages.

Every PushKV message is a few MiB, allocated and freed several times on its way (the
exported tensor, the encoded request, gRPC's slices, the received bytes). glibc serves such
sizes with fresh mmap()s, so each copy also pays a page fault and the kernel's zeroing per
4 KiB page, and its dynamic mmap threshold adapts only part of the way. Raising the mmap
threshold (and the trim threshold above it) keeps those buffers in the heap and reuses
their pages: side by side on the 2-core dev box, shim-to-shim transfer of 1k tokens of
llama-100m went from 0.58 to 0.77 GB/s with 8 MiB messages (docs/shim.md). The price is a heap that keeps up to
`TRIM_THRESHOLD_BYTES` of freed memory instead of returning it to the kernel at once.

Done with `mallopt` through ctypes because it is a libc call with no Python binding; on a
libc without it (musl, macOS) this does nothing. `MALLOC_*_` environment variables set by
the user win: glibc reads them first and this leaves the process alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def tune_for_large_buffers() -> bool:
    """Applies the thresholds; True when glibc took both."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either also turns off glibc's own adaptation of both (it would lower them).
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and ok
    if not ok:
        log.debug("mallopt refused the large-buffer thresholds; glibc defaults stay")
    return ok
