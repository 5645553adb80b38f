"""What the machine has: the memory a job's ranks can still take, for the checks that refuse a
job that cannot fit before it allocates (zerompi.train and zerompi.bench, docs/failures.md).

One concern: reading the machine. No MPI; CuPy only when asked about a GPU.
"""
import os
from typing import Optional


def host_available_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """Bytes of host memory new allocations can take now: Linux's MemAvailable, else the free
    physical pages; None where neither can be read (then nothing is refused)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def address_space_left() -> Optional[int]:
    """Bytes this process may still map under its address-space limit (``ulimit -v``, ``prlimit --as``),
    or None when there is none."""
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return max(0, limit - size)
    except (ImportError, OSError, ValueError, StopIteration):
        return None


def gpu_free_bytes(xp) -> Optional[int]:
    """Free bytes of the current GPU (``xp``: CuPy), or None when it cannot be asked."""
    try:
        return int(xp.cuda.runtime.memGetInfo()[0])
    except Exception:      # no CUDA runtime call available: nothing to compare with
        return None


def available_per_rank(placement) -> Optional[tuple]:
    """(bytes one rank of this node may take, words for the message) for a comm.device.Placement:
    the host's MemAvailable shared by the node's ranks, or the bound GPU's free memory shared by the
    ranks bound to it; None when unknown."""
    if placement is None or placement.kind == "cpu":
        total, sharing = host_available_bytes(), max(1, getattr(placement, "local_size", 1))
        where = "host memory available (MemAvailable)"
    else:
        total, sharing = gpu_free_bytes(placement.xp), max(1, -(-placement.local_size // max(1, placement.gpu_count)))
        where = f"free memory on GPU {placement.gpu}"
    if total is None:
        return None
    have = total // sharing, f"{human_bytes(total)} {where}, shared by {sharing} rank{'s' if sharing > 1 else ''} here"
    left = address_space_left() if placement is None or placement.kind == "cpu" else None
    if left is not None and left < have[0]:
        have = left, f"its address-space limit leaves {human_bytes(left)} (ulimit -v / prlimit --as)"
    return have


def human_bytes(n: float) -> str:
    """'1.5 GiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} PiB"
