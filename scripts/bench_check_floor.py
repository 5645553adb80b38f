"""The collectives' check with no Python around it: its messages against MPI's own all-gather, in C.

    python scripts/bench_check_floor.py                        # N = 2, 1 MiB and 64 MiB
    python scripts/bench_check_floor.py --ranks 4 --sizes 1M,16M --rounds 15

scripts/bench_signature.py measures the check as zerompi runs it, through mpi4py; its ratio at 1 MiB
holds Python's per-call cost. This measures the same messages made from C (scripts/bench_check_floor.c,
compiled here by the ``mpicc`` of the MPI library this Python's mpi4py uses: ``$MPICC``, else the one
beside this Python, else the first on PATH): an in-place all-gather as comm/checked.py's Plan makes it
(persistent requests, every peer's header then its data, the headers compared between the waits),
against MPI_Iallgather, the call zerompi makes unchecked, and against the same exchange without the
headers. Interleaved rounds, medians. Prints one JSON document: the sizes' records (microseconds per
call; ``ratio`` = checked / mpi, the per-round ratios' median). Exit status 2 with one line where no
mpicc is found or it fails to compile.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from launch import job_env, mpicc, mpiexec  # noqa: E402
from zerompi.bench.config import parse_size  # noqa: E402  (the collectives benchmark's sizes: 4096, 8K, 64M)
from zerompi.comm.signature import HEADER_BYTES  # noqa: E402
from zerompi.errors import ConfigError  # noqa: E402

SOURCE = ROOT / "scripts" / "bench_check_floor.c"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the job (default 2)")
    ap.add_argument("--sizes", default="1M,64M", help="all-gather sizes in bytes (K, M suffixes)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--seconds", type=float, default=0.02, help="length of one timed block (default 0.02)")
    a = ap.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",")]
    except ConfigError as e:
        ap.error(f"--sizes {a.sizes!r}: {e}")
    if a.ranks < 2 or a.rounds < 1 or not a.seconds > 0 or any(s < a.ranks for s in sizes):
        ap.error(f"--ranks {a.ranks} --rounds {a.rounds} --seconds {a.seconds} --sizes {a.sizes}: need "
                 "ranks >= 2, rounds >= 1, seconds > 0 and every size at least one byte per rank")
    compiler = mpicc()
    if compiler is None:
        print("bench_check_floor: no mpicc found ($MPICC, beside this Python, on PATH)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench_check_floor-") as tmp:
        program = os.path.join(tmp, "bench_check_floor")
        built = subprocess.run([compiler, "-O2", str(SOURCE), "-o", program], capture_output=True, text=True)
        if built.returncode != 0:
            print(f"bench_check_floor: {compiler} failed: {(built.stderr.strip().splitlines() or ['?'])[-1]}",
                  file=sys.stderr)
            return 2
        cmd = [mpiexec(), "-n", str(a.ranks), program, str(HEADER_BYTES), str(a.rounds), str(a.seconds)]
        proc = subprocess.run(cmd + [str(s) for s in sizes], capture_output=True, text=True, env=job_env(ROOT),
                              timeout=600)
    if proc.returncode != 0:
        print(f"bench_check_floor: exit {proc.returncode}: {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    print(json.dumps({"what": "the check's messages made from C against MPI_Iallgather (scripts/bench_check_floor.c)",
                      "mpicc": os.path.basename(compiler), "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
