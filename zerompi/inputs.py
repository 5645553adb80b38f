"""Opening and reading a file the user names as an input (a schedule, a run's metrics, the training data).

A path may name a FIFO (opening it waits for a writer that never comes), a device (``/dev/zero``
never ends) or a file far larger than any valid input: each is refused in one line naming the
file and what is allowed, before anything is read. The file is opened without blocking, checked
to be a regular file on the open descriptor (no window between a check and the open), and read
with a limit (a file that grows past it while it is read is refused too).
"""
import os
import stat
from typing import Type

from .errors import ConfigError

JSON_BYTES = 256 << 20              # a run's --metrics-json or a checkpoint's manifest, at most (each is a few MB)
KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str, what: str, error: Type[Exception] = ConfigError) -> int:
    """A read-only descriptor of ``path`` (the caller closes it); ``error`` naming ``what`` unless it is a regular
    file (symbolic links followed); OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in KINDS if test(mode)), "not a regular file")
        raise error(f"{what} is {kind}, not a regular file; give the path of a file")
    return fd


def read_bytes(path: str, what: str, limit: int, error: Type[Exception] = ConfigError) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them: ``error`` naming ``what`` when it is not
    a regular file or is larger; OSError when it cannot be read."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{what} has {size:,} bytes, more than the {limit:,} allowed for it; give a smaller file")
        parts, n = [], 0
        while n <= limit:                         # one byte past the limit tells a file that grew while read
            part = os.read(fd, min(limit + 1 - n, 1 << 20))
            if not part:
                break
            parts.append(part)
            n += len(part)
        if n > limit:
            raise error(f"{what} grew past the {limit:,} bytes allowed for it while it was read; give a smaller "
                        "file that nothing writes to")
        return b"".join(parts)
    finally:
        os.close(fd)
