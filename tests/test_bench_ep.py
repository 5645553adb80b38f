"""``zerompi.bench --ep K``: the all-to-all(v) over expert-parallel groups of K adjacent ranks, balanced and skewed
counts (comm/ep_alltoall.py's exchange beside MPI's Alltoallv on the same counts): every received row checked
bit-exact against the oracle of the sender's input, busbw from the bytes that leave a rank, records with the group
and the counts, a check that sees a broken exchange, and bad input. No timing is asserted."""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, one_line, run_mpi
from zerompi.bench import config as bench_config, ep_alltoallv
from zerompi.errors import ConfigError

SMALL = ["-b", "999", "-e", "200K", "-f", "8", "--iters", "2", "--warmup", "0", "--check"]


@pytest.mark.parametrize("n,k,dtype", [(4, 4, "fp32"), (4, 2, "fp16"), (3, 3, "fp16")])
def test_ep_rows_are_right_and_carry_the_group(tmp_path, n, k, dtype):
    path = tmp_path / "b.json"
    proc = run_mpi(n, ["-m", "zerompi.bench", "--ep", k, "--dtype", dtype, "--json", path, *SMALL], timeout=180)
    records = json.loads(path.read_text())
    isz = 2 if dtype == "fp16" else 4
    row = ep_alltoallv.ROW * isz
    sizes = sorted({r["bytes"] for r in records})
    assert len(sizes) >= 2
    assert [(r["bytes"], r["counts"], r["impl"]) for r in records] == [
        (b, c, i) for b in sizes for c in ("balanced", "skewed") for i in (ep_alltoallv.EP_IMPL, "mpi")]
    for r in records:
        assert r["wrong"] == 0, r
        assert (r["op"], r["ep"], r["group_size"], r["groups"], r["ranks"]) == ("all_to_allv", k, k, n // k, n), r
        rows = r["bytes"] // row
        assert r["bytes"] >= 999 and r["bytes"] % row == 0 and r["count"] * isz == r["bytes"]
        assert rows % int(np.lcm(k, 2 * (k - 1))) == 0
        sent = r["send_rows"]
        assert sum(sent) == rows and len(sent) == k
        if r["counts"] == "balanced":
            assert sent == [rows // k] * k
            assert r["busbw"] == pytest.approx(r["algbw"] * (k - 1) / k)
        else:                                       # group rank 0 takes half of every rank's rows
            assert sent == [rows // 2] + [rows // (2 * (k - 1))] * (k - 1)
        left = np.mean([(rows - s) * row for s in sent])
        assert r["left_bytes"] == pytest.approx(left)
        assert r["busbw"] == pytest.approx(left / (r["time_us"] * 1e-6) / 1e9)
        assert r["recv_max_bytes"] == (k - 1) * max(sent) * row
        assert r["algbw"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
    assert f"expert-parallel groups: {n // k} of {k} adjacent ranks ({list(range(k))}, ...;" in proc.stdout
    for pattern in ("balanced", "skewed"):
        assert f"# all_to_allv {pattern} busbw {ep_alltoallv.EP_IMPL}/mpi: median" in proc.stdout


@pytest.mark.parametrize("mode", ["lastbit", "order"])
def test_the_check_sees_a_broken_exchange(tmp_path, mode):
    """One flipped bit per EP group's rank 1 and row, or the source blocks out of order: only zerompi-ep's rows are
    counted wrong, by exactly that much for the bit."""
    path = tmp_path / "b.json"
    run_mpi(4, [ROOT / "tests" / "drivers" / "bench_ep_broken.py", mode, "--ep", "2", "--json", path, *SMALL],
            timeout=180)
    records = json.loads(path.read_text())
    assert {r["impl"] for r in records if r["wrong"]} == {ep_alltoallv.EP_IMPL}, records
    for r in records:
        if r["impl"] == ep_alltoallv.EP_IMPL:
            # 2 groups of 2: each group's rank 1 flips one element (lastbit); out of order, every element of the
            # two blocks each of the 4 ranks receives is another rank's
            assert r["wrong"] == (2 if mode == "lastbit" else 4 * 2 * r["send_rows"][0] * ep_alltoallv.ROW), r


def test_counts_and_padding():
    assert ep_alltoallv.send_rows("balanced", 12, 4).tolist() == [3, 3, 3, 3]
    assert ep_alltoallv.send_rows("skewed", 12, 4).tolist() == [6, 2, 2, 2]
    assert ep_alltoallv.rows_quantum(4) == 12 and ep_alltoallv.rows_quantum(2) == 2
    assert ep_alltoallv.padded_rows(1, 4, 4) == 12 and ep_alltoallv.padded_rows(13 * 4096, 4, 4) == 24
    cfg = bench_config.parse_config(["--ep", "2"])
    assert cfg.ops == ("all_to_allv",) and cfg.row_impls() == (ep_alltoallv.EP_IMPL, "mpi") and cfg.ep == 2
    assert bench_config.parse_config(["--ep", "4", "--impl", "mpi"]).row_impls() == ("mpi",)
    assert bench_config.parse_config([]).ep is None


@pytest.mark.parametrize("flags,needle", [
    (["--ep", "1"], "ep=1 makes groups of one rank"),
    (["--ep", "0"], "ep=0 must be a whole number of ranks >= 2"),
    (["--ep", "2", "--op", "all_reduce"], "op=all_reduce has no --ep rows"),
    (["--op", "all_to_allv"], "op=all_to_allv needs --ep K"),
    (["--ep", "2", "--tp", "2"], "ep=2 and tp=2 measure different tables"),
    (["--ep", "2", "--sp", "2"], "ep=2 and sp=2 measure different tables"),
    (["--ep", "2", "--impl", "zerompi,zerompi-q8"], "impl=zerompi-q8 has no --ep rows"),
    (["--ep", "2", "--node-size", "2"], "ep=2 and node_size=2 measure different tables"),
    (["--ep", "2", "--device", "gpu"], "ep=2 needs --device cpu"),
])
def test_bad_ep_flags(flags, needle):
    with pytest.raises(ConfigError) as e:
        bench_config.parse_config(flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_ep_input_exits_2_in_one_line():
    proc = run_mpi(4, ["-m", "zerompi.bench", "--ep", "3"], timeout=60, check=False)
    one_line(proc, 2, "zerompi.bench: error: ", "ep=3 does not divide the 4 ranks; the ranks form groups of ep")
    assert proc.stdout == ""


def test_plot_draws_a_line_per_pattern():
    """--plot: the all-to-all(v) panel has a line per implementation and count pattern."""
    pytest.importorskip("matplotlib")
    from zerompi.bench.plot import busbw_figure
    recs = [{"op": "all_to_allv", "impl": impl, "counts": c, "bytes": b, "busbw": 1.0, "copy_GBps": 9.0,
             "ranks": 4, "dtype": "fp32"} for b in (4096, 8192) for c in ("balanced", "skewed")
            for impl in (ep_alltoallv.EP_IMPL, "mpi")]
    ax = busbw_figure(recs).axes[0]
    assert ax.get_title() == "all_to_allv"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "zerompi-ep (balanced)", "mpi (balanced)", "zerompi-ep (skewed)", "mpi (skewed)", "copy ceiling"]
