"""NcclCommunicator (``--comm nccl``) on the CPU: its NCCL calls replaced by the host
Communicator (tests/drivers/nccl_host.py), the rest -- slices, scale and accumulate in fp32
after the sum, in-place all-gather, all-reduce, handles, accounting -- against the float64
oracle at N = 1..4. The NCCL calls themselves need GPUs (scripts/gpu_check.sh, N = 1)."""
import json

import pytest

from tests.mpirun import ROOT, run_mpi

from zerompi.errors import ConfigError


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_nccl_logic_matches_the_oracle(n):
    proc = run_mpi(n, [ROOT / "tests" / "drivers" / "nccl_host.py"], timeout=90)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases = [r for r in lines if "case" in r]
    footer = next(r for r in lines if "stats" in r)
    assert len(cases) == 2 * 3 * (3 + 2), proc.stdout
    bad = [r for r in cases if r["wrong"] or r["bits_differ"]]
    assert not bad, bad
    assert footer["calls"] == ["all_gather", "all_reduce", "reduce_scatter"]


def test_nccl_needs_the_gpu():
    from zerompi.train.config import parse_config
    with pytest.raises(ConfigError, match="comm='nccl' needs --device gpu"):
        parse_config(["--comm", "nccl"])
    with pytest.raises(ConfigError, match="comm='tcp' is not allowed; use mpi or nccl"):
        parse_config(["--comm", "tcp"])
