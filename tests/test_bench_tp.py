"""``zerompi.bench --tp K``: the all-reduce over tensor-parallel groups of K adjacent ranks (the Mesh's
TP all-reduce beside MPI's Allreduce on the same group), checked against the float64 oracle of each
group's own sum, busbw with the group's bus factor, records with the group size, and bad input."""
import json

import pytest

from tests.mpirun import ROOT, one_line, run_mpi
from zerompi.bench import config as bench_config, tp_allreduce
from zerompi.errors import ConfigError

SMALL = ["-b", "999", "-e", "20K", "-f", "5", "--iters", "2", "--warmup", "0", "--check"]


@pytest.mark.parametrize("n,k,dtype", [(4, 2, "fp32"), (4, 4, "fp16"), (6, 3, "fp32"), (4, 2, "fp16")])
def test_tp_rows_are_right_and_carry_the_group(tmp_path, n, k, dtype):
    path = tmp_path / "b.json"
    proc = run_mpi(n, ["-m", "zerompi.bench", "--tp", k, "--dtype", dtype, "--json", path, *SMALL], timeout=180)
    records = json.loads(path.read_text())
    assert [(r["op"], r["impl"]) for r in records] == [("all_reduce", i) for i in (tp_allreduce.TP_IMPL, "mpi")] * 2
    isz = 2 if dtype == "fp16" else 4
    for r in records:
        assert r["wrong"] == 0, r
        assert (r["tp"], r["group_size"], r["groups"], r["ranks"]) == (k, k, n // k, n), r
        assert r["bytes"] >= 999 and r["bytes"] % (k * isz) == 0 and r["bytes"] == r["count"] * (4 if r["type"] ==
                                                                                                 "float*" else isz)
        assert r["algbw"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (k - 1) / k)
    assert records[0]["overlap_pct"] is None and records[1]["overlap_pct"] is not None   # no non-blocking TP form
    first = [[d * k + t for t in range(k)] for d in range(n // k)][0]
    assert f"tensor-parallel groups: {n // k} of {k} adjacent ranks ({first}, ...; zerompi.Mesh)" in proc.stdout
    assert f"# Avg bus bandwidth {tp_allreduce.TP_IMPL}:" in proc.stdout


@pytest.mark.parametrize("mode,rows", [("skip", {tp_allreduce.TP_IMPL}), ("lastbit", {tp_allreduce.TP_IMPL})])
def test_the_check_sees_a_broken_tp_all_reduce(tmp_path, mode, rows):
    """The oracle counts an all-reduce that did nothing; the bit check one TP rank whose result differs."""
    path = tmp_path / "b.json"
    run_mpi(4, [ROOT / "tests" / "drivers" / "bench_tp_broken.py", mode, "--tp", "2", "--json", path, *SMALL],
            timeout=180)
    records = json.loads(path.read_text())
    bad = {r["impl"] for r in records if r["wrong"]}
    assert bad == rows, records
    for r in records:
        if r["impl"] == tp_allreduce.TP_IMPL:
            # skip: every element of every rank against the oracle (each keeps its own input), and every element
            # of each group's rank 1 against its rank 0's bits; lastbit: one element on each group's rank 1
            assert r["wrong"] == (4 * r["count"] + 2 * r["count"] if mode == "skip" else 2), r


def test_tp_config():
    cfg = bench_config.parse_config(["--tp", "2"])
    assert cfg.ops == ("all_reduce",) and cfg.row_impls() == (tp_allreduce.TP_IMPL, "mpi") and cfg.tp == 2
    assert bench_config.parse_config(["--tp", "2", "--impl", "mpi"]).row_impls() == ("mpi",)
    assert bench_config.parse_config(["--tp", "2", "--op", "all_reduce"]).ops == ("all_reduce",)
    assert bench_config.parse_config([]).tp is None


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "0"], "tp=0 must be a whole number of ranks >= 2"),
    (["--tp", "-2"], "tp=-2 must be a whole number of ranks >= 2"),
    (["--tp", "1"], "tp=1 makes groups of one rank"),
    (["--tp", "two"], "--tp: invalid int value: 'two'"),
    (["--tp", "2", "--op", "reduce_scatter"], "op=reduce_scatter has no --tp rows"),
    (["--tp", "2", "--impl", "zerompi,zerompi-q8"], "impl=zerompi-q8 has no --tp rows"),
    (["--tp", "2", "--node-size", "2"], "tp=2 and node_size=2 measure different tables"),
    (["--tp", "2", "--device", "gpu"], "tp=2 needs --device cpu"),
])
def test_bad_tp_flags(flags, needle):
    with pytest.raises(ConfigError) as e:
        bench_config.parse_config(flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "3"], "tp=3 does not divide the 4 ranks; use a divisor of 4"),
    (["--tp", "8"], "tp=8 does not divide the 4 ranks"),
    (["--tp", "0"], "tp=0 must be a whole number of ranks >= 2"),
    (["--tp", "2", "--op", "all_gather"], "op=all_gather has no --tp rows"),
])
def test_bad_tp_input_exits_2_in_one_line(flags, needle):
    proc = run_mpi(4, ["-m", "zerompi.bench", *flags], timeout=60, check=False)
    one_line(proc, 2, "zerompi.bench: error: ", needle)
    assert proc.stdout == ""
