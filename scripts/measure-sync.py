#!/usr/bin/env python3
"""Times a write plus fdatasync on the disk that holds DIR (default: the current directory),
four ways, to show what the journal's spare segments (docs/persistence.md) buy on it:

  append  the file grows with every write (a segment without a spare)
  zeros   the file was filled with zeros and synced first (a spare segment)
  falloc  the space was reserved with posix_fallocate (unwritten extents)
  dsync   as zeros, but the file is opened O_DSYNC and the write itself waits

    scripts/measure-sync.py [WRITE_BYTES [WRITES [DIR]]]   (default 33000 2000 .)

Prints the median and p99 of each, in µs. Run it on a quiet machine.
"""
import os
import sys
import time

size = int(sys.argv[1]) if len(sys.argv) > 1 else 33000
count = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
path = os.path.join(sys.argv[3] if len(sys.argv) > 3 else ".", "measure-sync.tmp")


def run(mode):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    total = count * size
    if mode in ("zeros", "dsync"):
        for _ in range(0, total, 1 << 20):
            os.write(fd, bytes(1 << 20))
        os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_SET)
    elif mode == "falloc":
        os.posix_fallocate(fd, 0, total)
        os.fsync(fd)
    if mode == "dsync":
        os.close(fd)
        fd = os.open(path, os.O_RDWR | os.O_DSYNC)
    data = b"x" * size
    times = []
    for _ in range(count):
        started = time.perf_counter()
        os.write(fd, data)
        if mode != "dsync":
            os.fdatasync(fd)
        times.append(time.perf_counter() - started)
    os.close(fd)
    os.unlink(path)
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


for mode in ("append", "zeros", "falloc", "dsync"):
    p50, p99 = run(mode)
    print(f"{mode:7} {size} B: p50 {p50:6.0f} µs  p99 {p99:6.0f} µs")
