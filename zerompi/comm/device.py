"""Where a rank's arrays live: the host (NumPy) or a GPU (CuPy), which GPU, and how MPI
reaches device memory.

``--device auto|cpu|gpu``: ``auto`` is ``gpu`` when CuPy imports and sees a GPU, else
``cpu``. On a GPU each rank binds device ``local_rank % device_count``, the local rank
being its rank among the ranks of its node (an MPI shared-memory split); several ranks
may share one GPU.

MPI on device buffers: :func:`mpi_cuda_aware` asks the MPI library
(``MPIX_Query_cuda_support``, which MPICH and Open MPI export) and can be overridden with
``ZEROMPI_CUDA_AWARE=0|1``. Where MPI is not CUDA-aware, collectives on device buffers go
through pinned host buffers (zerompi/comm/staging.py).
"""
import ctypes
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np

from ..errors import ConfigError, agree_on_errors, check

DEVICES = ("auto", "cpu", "gpu")
CUDA_AWARE_ENV = "ZEROMPI_CUDA_AWARE"


@dataclass(frozen=True)
class Placement:
    """One rank's device: what it computes on, and how it was chosen."""
    kind: str                 # "cpu" or "gpu"
    xp: object                # numpy or cupy: the array module of every engine buffer
    local_rank: int           # rank among the ranks of this node
    local_size: int           # ranks on this node
    gpu: Optional[int] = None  # the CUDA device index bound, on "gpu"
    gpu_count: int = 0        # GPUs this rank sees
    name: str = "cpu"         # the GPU's name, or "cpu"
    note: str = ""            # why auto chose the CPU ("" otherwise)

    def describe(self) -> str:
        """One line for the banner."""
        if self.kind == "cpu":
            return "cpu (NumPy)" + (f"; {self.note}" if self.note else "")
        shared = f", shared by {self.local_size} local ranks" if self.local_size > self.gpu_count else ""
        return f"gpu {self.gpu} of {self.gpu_count} ({self.name}{shared}; CuPy)"


def node_rank(mpi_comm) -> Tuple[int, int]:
    """(rank among this node's ranks, ranks on this node), from an MPI shared-memory split."""
    from mpi4py import MPI
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def probe_gpus() -> Tuple[int, str]:
    """(GPUs CuPy sees, "" or why none): never raises."""
    try:
        import cupy
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:   # ImportError, or CUDA's own error when no driver or device is present
        first = str(e).splitlines()[0] if str(e) else "no detail"
        return 0, f"{type(e).__name__}: {first}"
    return count, "" if count else "CuPy sees no GPU"


def bind_gpu(index: int) -> Tuple[object, str]:
    """Make GPU ``index`` this process's current device; returns (cupy, its name)."""
    import cupy
    cupy.cuda.Device(index).use()
    name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
    return cupy, name.decode() if isinstance(name, bytes) else str(name)


def place(choice: str, mpi_comm, probe: Callable[[], Tuple[int, str]] = probe_gpus,
          bind: Callable[[int], Tuple[object, str]] = bind_gpu) -> Placement:
    """Choose and bind this rank's device. ``choice``: auto, cpu or gpu.

    ConfigError (one line) for an unknown choice, or for ``gpu`` when CuPy or a GPU is
    missing. ``probe`` and ``bind`` are CuPy's by default (tests pass stand-ins).
    """
    check(choice in DEVICES, f"device={choice!r} is not allowed; use auto, cpu or gpu")
    local, size = node_rank(mpi_comm)
    if choice == "cpu":
        return Placement("cpu", np, local, size)
    count, why = probe()
    if count == 0:
        if choice == "gpu":
            raise ConfigError(f"device='gpu' needs CuPy and a visible GPU ({why}); use --device cpu")
        return Placement("cpu", np, local, size, note=f"no GPU: {why}")
    index = local % count
    xp, name = bind(index)
    return Placement("gpu", xp, local, size, gpu=index, gpu_count=count, name=name)


def place_every_rank(choice: str, mpi_comm, prog: str) -> Optional[Placement]:
    """:func:`place` on every rank, the ranks agreeing on errors: the Placement, or None after
    rank 0 has printed the one-line error (the caller exits 2). Every rank must call it:
    place() starts with a collective (the node split)."""
    placement, error = None, None
    try:
        placement = place(choice, mpi_comm)
    except ConfigError as e:
        error = str(e)
    return None if agree_on_errors(mpi_comm, error, prog) else placement


def describe_buffers(placement: Optional[Placement], comm) -> str:
    """The banner's words for where the buffers are and how collectives reach them
    (``comm``: the engine's Communicator, whose ``path`` names the device path)."""
    if placement is None or placement.kind == "cpu":
        return "host buffers (NumPy)" + (f"; {placement.note}" if placement is not None and placement.note else "")
    aware, how = mpi_cuda_aware()
    return (f"device buffers on {placement.describe()}, collectives {comm.path} "
            f"(MPI CUDA-aware: {'yes' if aware else 'no'}, {how})")


def _loaded_mpi_library():
    """The MPI library mpi4py loaded, as a ctypes handle (through mpi4py's extension module,
    whose symbol lookup reaches the libmpi it links), or None."""
    try:
        from mpi4py import MPI
        return ctypes.CDLL(MPI.__file__)
    except (ImportError, OSError, AttributeError):
        return None


def mpi_cuda_aware(environ=os.environ, library=None) -> Tuple[bool, str]:
    """(whether MPI takes device buffers, how that was decided).

    ``ZEROMPI_CUDA_AWARE=0|1`` decides when set; else ``MPIX_Query_cuda_support()`` of the
    loaded MPI library (MPICH >= 4, Open MPI >= 4); a library without it counts as not
    aware (staging through host memory is always correct, only slower).
    """
    text = environ.get(CUDA_AWARE_ENV, "").strip()
    if text:
        if text not in ("0", "1"):
            raise ConfigError(f"{CUDA_AWARE_ENV}={text!r} is not allowed; use 0 (stage through host "
                              "memory) or 1 (pass device buffers to MPI)")
        return text == "1", f"{CUDA_AWARE_ENV}={text}"
    lib = library if library is not None else _loaded_mpi_library()
    query = getattr(lib, "MPIX_Query_cuda_support", None) if lib is not None else None
    if query is None:
        return False, "the MPI library has no MPIX_Query_cuda_support"
    query.restype = ctypes.c_int
    query.argtypes = []
    aware = bool(query())
    return aware, f"MPIX_Query_cuda_support() = {int(aware)}"
