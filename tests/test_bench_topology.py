"""``zerompi.bench --node-size K``: the two-level rows beside the flat ones, checked against the
float64 oracle, and the bytes of one call inside and across nodes against the formulas."""
import json

import pytest

from tests.mpirun import no_python_noise, run_mpi, zerompi_lines
from zerompi.bench import config as bench_config, levels, run as bench
from zerompi.errors import ConfigError

SMALL = ["-b", "999", "-e", "20K", "-f", "5", "--iters", "1", "--warmup", "0", "--check", "--no-overlap"]


def want_bytes(impl: str, op: str, nbytes: int, n: int, k: int):
    """(intra, inter) bytes one rank sends in one call, by hand. Flat: to each of the N-1 peers its
    slice (B/N), K-1 of them on its node; two-level: (K-1)/K of the bucket inside the node, then
    1/K x (M-1)/M of it across. An all-reduce is a reduce-scatter and an all-gather."""
    m = n // k
    if impl == "mpi":
        return None, None
    twice = 2 if op == "all_reduce" else 1
    if impl == "zerompi":
        return twice * (k - 1) * nbytes // n, twice * (n - k) * nbytes // n
    return twice * (k - 1) * nbytes // k, twice * (m - 1) * nbytes // n


@pytest.mark.parametrize("n,k,dtype", [(4, 2, "fp16"), (6, 3, "fp32"), (6, 2, "fp16"), (4, 1, "fp32")])
def test_two_level_rows_are_right_and_count_bytes_per_level(tmp_path, n, k, dtype):
    path = tmp_path / "b.json"
    proc = run_mpi(n, ["-m", "zerompi.bench", "--op", "all", "--dtype", dtype, "--node-size", k, "--json", path,
                       *SMALL], timeout=120)
    records = json.loads(path.read_text())
    impls = ("zerompi", levels.TWO_LEVEL, "mpi")
    assert [(r["op"], r["impl"]) for r in records[:3]] == [("reduce_scatter", i) for i in impls]
    assert {(r["op"], r["impl"]) for r in records} == {(op, i) for op in bench_config.OPS for i in impls}
    assert len(records) == 3 * 3 * 2                       # ops x impls x sizes
    for r in records:
        assert r["wrong"] == 0, r
        assert r["node_size"] == k and r["ranks"] == n
        assert (r["intra_bytes"], r["inter_bytes"]) == want_bytes(r["impl"], r["op"], r["bytes"], n, k), r
    assert f"nodes: {n // k} of {k} ranks (simulated)" in proc.stdout
    assert f"# Avg bus bandwidth {levels.TWO_LEVEL}:" in proc.stdout


def test_without_node_size_the_table_is_as_before(tmp_path):
    path = tmp_path / "b.json"
    run_mpi(2, ["-m", "zerompi.bench", "--op", "reduce_scatter", "--json", path, *SMALL], timeout=60)
    records = json.loads(path.read_text())
    assert {r["impl"] for r in records} == {"zerompi", "mpi"}
    assert not any("intra_bytes" in r for r in records)


def test_row_impls():
    assert bench.parse_config(["--node-size", "2"]).row_impls() == ("zerompi", levels.TWO_LEVEL, "mpi")
    assert bench.parse_config(["--node-size", "2", "--impl", "mpi"]).row_impls() == (levels.TWO_LEVEL, "mpi")
    assert bench.parse_config([]).row_impls() == ("zerompi", "mpi")


@pytest.mark.parametrize("flags,needle", [(["--node-size", "0"], "node_size=0 must be a whole number of ranks >= 1"),
                                          (["--node-size", "two"], "--node-size: invalid int value: 'two'")])
def test_bad_node_size_flags(flags, needle):
    with pytest.raises(ConfigError) as e:
        bench.parse_config(flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags,needle", [
    (["--node-size", "3"], "node_size=3 does not divide the 4 ranks; use a divisor of 4 below 4"),
    (["--node-size", "4"], "node_size=4 puts all 4 ranks on one node"),
    (["--node-size", "2", "--device", "gpu"], "node_size=2 needs --device cpu"),
])
def test_node_sizes_that_do_not_fit_exit_2_on_every_rank(flags, needle):
    proc = run_mpi(4, ["-m", "zerompi.bench", *flags], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = zerompi_lines(proc.stderr)     # zerompi's own lines: a launcher may add its banner
    no_python_noise(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("zerompi.bench: error: ") and needle in lines[0], proc.stderr
    assert proc.stdout == ""
