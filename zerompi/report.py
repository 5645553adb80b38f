"""What rank 0 prints: the start-up banner, progress lines and the final tables."""
import sys
from typing import Dict

from mpi4py import MPI


def print0(comm, *args, **kwargs) -> None:
    """print on rank 0 only, flushed."""
    if comm.Get_rank() == 0:
        print(*args, **kwargs)
        sys.stdout.flush()


def mpi_library() -> str:
    """First line of the MPI library's version string, e.g. 'MPICH Version: 4.2.0'."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n:.2f} TiB"


def memory_table(measured: Dict[str, int], theory: Dict[str, int], padded: Dict[str, int],
                 stage: int, world_size: int, itemsize: int) -> str:
    """Measured model-state bytes per rank beside DESIGN.md's formula."""
    p = itemsize
    formulas = {
        0: (f"{p}Ψ", f"{p}Ψ", "12Ψ"),
        1: (f"{p}Ψ", f"{p}Ψ", "12Ψ/N"),
        2: (f"{p}Ψ", f"{p}Ψ/N", "12Ψ/N"),
        3: (f"{p}Ψ/N", f"{p}Ψ/N", "12Ψ/N"),
    }[stage]
    totals = {0: f"{2 * p + 12}Ψ", 1: f"{2 * p}Ψ + 12Ψ/N", 2: f"{p}Ψ + {p + 12}Ψ/N", 3: f"{2 * p + 12}Ψ/N"}[stage]
    rows = [("params", formulas[0]), ("grads", formulas[1]), ("optimizer", formulas[2]), ("total", totals)]
    lines = [f"memory per rank (stage {stage}, N={world_size}): measured vs formula",
             f"  {'':10} {'measured':>14} {'formula':>14} {'formula, padded':>16}  formula",
             ]
    for key, text in rows:
        lines.append(f"  {key:10} {human_bytes(measured[key]):>14} {human_bytes(theory[key]):>14} "
                     f"{human_bytes(padded[key]):>16}  {text}")
    return "\n".join(lines)


def comm_table(measured: Dict[str, float], theory: float, stage: int) -> str:
    """Measured bytes sent per rank per step beside the formula."""
    lines = ["communication per rank per step: measured vs formula"]
    for op, nbytes in measured.items():
        lines.append(f"  {op:16} {human_bytes(nbytes):>14}")
    total = sum(measured.values())
    what = "3Ψ (gather fwd + gather bwd + reduce-scatter)" if stage == 3 else "2Ψ (reduce-scatter + all-gather)"
    lines.append(f"  {'total':16} {human_bytes(total):>14}   formula {human_bytes(theory)} = {what} × (N-1)/N bytes")
    return "\n".join(lines)
