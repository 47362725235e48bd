"""Run 51 (2026-12-07, twenty-second session): how fast the same-GPU KV copy of an 8,176-token
send can go. pool_ipc.copy_runs copies a run of slots of every plane in one strided copy_ of
a [planes, slots, words] view (int64 words); here that against one contiguous copy per plane,
16-byte elements (complex128 words), and a plain contiguous memcpy of the same bytes. llama-1b's
pool: 32 planes (16 layers, K and V), 1,024 bytes a slot, 65,536 slots a plane."""

import time

import torch

planes, slots, slot_bytes, n = 32, 65536, 1024, 8176
dev = torch.device("cuda")
src = torch.randint(0, 255, (planes * slots * slot_bytes,), dtype=torch.uint8, device=dev)
dst = torch.zeros_like(src)
nbytes = planes * n * slot_bytes


def view(flat, dtype):
    return flat.view(torch.uint8).reshape(planes, slots, slot_bytes).view(dtype)


s64, d64 = view(src, torch.int64), view(dst, torch.int64)
s128, d128 = view(src, torch.complex128), view(dst, torch.complex128)
l0, r0 = 1000, 30000


def strided64():
    d64[:, r0:r0 + n].copy_(s64[:, l0:l0 + n], non_blocking=True)


def strided128():
    d128[:, r0:r0 + n].copy_(s128[:, l0:l0 + n], non_blocking=True)


def per_plane():
    for p in range(planes):
        d64[p, r0:r0 + n].copy_(s64[p, l0:l0 + n], non_blocking=True)


flat_src, flat_dst = src[:nbytes], dst[slots * slot_bytes:slots * slot_bytes + nbytes]


def contiguous():
    flat_dst.copy_(flat_src, non_blocking=True)


def check():
    ok = torch.equal(d64[:, r0:r0 + n], s64[:, l0:l0 + n])
    dst.zero_()
    return ok


for name, fn in [("strided int64 (now)", strided64), ("strided complex128", strided128),
                 ("one copy a plane", per_plane), ("contiguous memcpy", contiguous)]:
    fn()
    torch.cuda.synchronize()
    ok = check() if fn is not contiguous else True
    times, cpu = [], []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        t1 = time.perf_counter()
        b.synchronize()
        times.append(a.elapsed_time(b))
        cpu.append((t1 - t0) * 1e3)
    times.sort()
    cpu.sort()
    med = times[len(times) // 2]
    print(f"{name:22s} GPU {med:.3f} ms ({nbytes / med / 1e6:.0f} GB/s), launch CPU {cpu[len(cpu) // 2]:.3f} ms, exact {ok}")
