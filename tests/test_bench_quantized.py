"""``zerompi.bench --impl zerompi-q8,zerompi-q4``: the quantized rows find no wrong element and stay
within their bound at N = 1, 2, 3, count their wire bytes by the formula, and the check is not
vacuous (the error metric against hand-computed cases, a broken result or bound is caught)."""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, no_python_noise, run_mpi, zerompi_lines
from zerompi.bench import cases, config as bench_config, levels, quantized as bq, records as bench_records
from zerompi.comm.quantized import Quantization
from zerompi.errors import ConfigError
from zerompi.optim import reference as R

SMALL = ["-b", "999", "-e", "20K", "-f", "5", "--iters", "1", "--warmup", "0", "--check", "--no-overlap"]
QUANT = ("zerompi-q8", "zerompi-q4")


def wire_by_hand(bits: int, k: int, block: int) -> int:
    """A k-element slice on the wire: the values (k bytes, or (k + 1) // 2 for int4) padded to 4,
    then a 4-byte scale per block."""
    values = k if bits == 8 else (k + 1) // 2
    return (values + 3) // 4 * 4 + 4 * ((k + block - 1) // block)


def beta_by_hand(n: int, bits: int, dtype) -> float:
    u = 2.0 ** -24 if dtype == "fp32" else 2.0 ** -11
    return 0.5 + ({8: 127, 4: 7}[bits] + 1) * ((n + 3) * 2.0 ** -24 + 2 * u)


def check_records(records, n, dtype, block):
    for r in records:
        assert r["wrong"] == 0, r
        k = r["count"] // n
        bits = bench_config.quant_bits(r["impl"])
        assert r["busbw"] == pytest.approx(r["algbw"] * bench_records.bus_factor(r["op"], n))   # on the logical bytes
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        if bits is None:
            assert r["wire_bytes"] == r["bytes"] and r["quant"] is None and r["quant_err_max"] is None
            continue
        assert r["op"] != "all_reduce"
        assert r["quant"] == {"bits": bits, "block": block}
        assert r["wire_bytes"] == n * wire_by_hand(bits, k, block), r
        terms = n if r["op"] == "reduce_scatter" else 1
        assert r["quant_err_bound"] == pytest.approx(beta_by_hand(terms, bits, dtype), rel=1e-12)
        assert 0.2 < r["quant_err_max"] <= r["quant_err_bound"], r      # real error, within the bound
        assert 0.05 < r["quant_err_rms"] <= r["quant_err_max"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_quantized_rows_are_right_within_their_bound(n, tmp_path):
    """Both dtypes; 999 B and 4995 B buffers (padded to whole slices) cut slices whose last block
    is short; --quant-block 16 in one run."""
    for dtype, block in (("fp32", 64), ("fp16", 16 if n == 3 else 64)):
        path = tmp_path / f"{dtype}.json"
        proc = run_mpi(n, ["-m", "zerompi.bench", "--impl", "zerompi,zerompi-q8,zerompi-q4", "--dtype", dtype,
                           "--quant-block", block, "--json", path, *SMALL], timeout=120)
        records = json.loads(path.read_text())
        quant_ops = [(op, i) for op in ("reduce_scatter", "all_gather") for i in QUANT]
        assert {(r["op"], r["impl"]) for r in records} == \
            {(op, "zerompi") for op in bench_config.OPS} | set(quant_ops)        # no quantized all-reduce
        assert len(records) == (3 + 4) * 2
        assert any(r["count"] // n % block for r in records if r["quant"])   # a short last block
        check_records(records, n, dtype, block)
        assert "quantized rows: |result - exact| <= bound x scale" in proc.stdout
        assert "# zerompi-q4 all_gather: wire" in proc.stdout


def test_all_gather_error_reaches_half_a_step(tmp_path):
    """The all-gather's error is the quantizer's own: over thousands of elements its max is near the
    scale / 2 that must hold (so a bound of scale / 4 would fail), and the RMS near 1 / sqrt(12)."""
    path = tmp_path / "b.json"
    run_mpi(2, ["-m", "zerompi.bench", "--op", "all_gather", "--impl", "zerompi-q4", "-b", "64K", "-e", "64K",
                "--json", path, *SMALL[4:]], timeout=90)
    (r,) = json.loads(path.read_text())
    assert 0.45 < r["quant_err_max"] <= 0.5 + 1e-5 and abs(r["quant_err_rms"] - 12 ** -0.5) < 0.02, r


def test_staged_device_path_runs_the_quantized_rows():
    """--device gpu's wiring on the CPU: the quantized rows through the staged Communicator."""
    proc = run_mpi(3, [ROOT / "tests" / "drivers" / "bench_staged.py", "--impl", "zerompi-q8,zerompi-q4", "-b", "1000",
                       "-e", "70000", "-f", "8", "--dtype", "fp16"], timeout=120)
    out = json.loads(proc.stdout.splitlines()[-1])
    assert len(out["records"]) == 2 * 2 * 3 and all(r["wrong"] == 0 for r in out["records"]), out["records"]
    assert all(r["quant_err_max"] <= r["quant_err_bound"] for r in out["records"])
    assert out["staged"]["to_host_bytes"] > 0


def test_two_level_quantized_rows_count_wire_bytes_per_level(tmp_path):
    """--node-size: zerompi-2level-q8/-q4 beside the flat ones; one call's bytes inside and across nodes
    by hand: flat, a slice's wire block to each peer; two levels, a super-slice's (M slices) inside the
    node and a slice's across (the all-gather: M wire blocks inside the node)."""
    n, kk, dtype = 4, 2, "fp16"
    m = n // kk
    path = tmp_path / "b.json"
    run_mpi(n, ["-m", "zerompi.bench", "--impl", "zerompi-q8,zerompi-q4,mpi", "--node-size", kk, "--dtype", dtype,
                "--json", path, *SMALL], timeout=150)
    records = json.loads(path.read_text())
    impls = [r["impl"] for r in records if r["op"] == "reduce_scatter"][:6]
    assert impls == [levels.TWO_LEVEL, "zerompi-q8", "zerompi-2level-q8", "zerompi-q4", "zerompi-2level-q4", "mpi"]
    check_records(records, n, dtype, 64)
    for r in records:
        bits = bench_config.quant_bits(r["impl"])
        if bits is None:
            continue
        k = r["count"] // n
        w = lambda e: wire_by_hand(bits, e, 64)
        if r["impl"].startswith(levels.TWO_LEVEL):
            want = ((kk - 1) * w(m * k), (m - 1) * w(k)) if r["op"] == "reduce_scatter" else \
                ((kk - 1) * m * w(k), (m - 1) * w(k))
        else:
            want = ((kk - 1) * w(k), (n - kk) * w(k))
        assert (r["intra_bytes"], r["inter_bytes"]) == want, r


# ---- the check itself, by hand ----------------------------------------------------------------
def test_error_metric_by_hand():
    exact = np.zeros(5)
    scales = np.array([1.0, 2.0, 0.0, 4.0, 0.0])
    got = np.array([0.5, -0.4, 0.0, 3.0, 0.0], np.float32)
    wrong, mx, sq, count = bq.errors(got, exact, scales, 0.6, 0.0)
    assert (wrong, mx, count) == (1, 0.75, 5)                  # 3 / 4 > 0.6; ratios 0.5, 0.2, 0, 0.75, 0
    assert sq == pytest.approx(0.25 + 0.04 + 0.5625)
    got[4] = 1e-30                                              # any error where the scale is 0 is wrong
    got[0] = np.nan
    wrong, mx, _, _ = bq.errors(got, exact, scales, 0.6, 0.0)
    assert wrong == 3 and mx == np.inf
    assert bq.beta(4, 8, np.float32) == 0.5 + 128 * 9 * 2.0 ** -24
    assert bq.beta(1, 4, np.float16) == 0.5 + 8 * (4 * 2.0 ** -24 + 2 ** -10)


def test_scales_by_hand():
    """D for a reduce-scatter's slice: the ranks' block scales (max |x| / qmax in float32) summed; with
    two levels, plus each node's largest summed scale within each block of the slice that crosses."""
    q, dt = Quantization(8, 8), np.float32
    n, k, slot = 3, 20, 1                                       # blocks of 8, 8, 4 in each slice
    want = np.zeros(k)
    for r in range(n):
        x = cases.rank_values(r, slot * k, (slot + 1) * k).astype(dt)
        for lo in range(0, k, 8):
            want[lo:lo + 8] += float(np.float32(np.abs(x[lo:lo + 8]).max()) / np.float32(127))
    assert np.array_equal(bq.reduce_scatter_scales(dt, n, q, slot, k), want)
    # two levels: 4 ranks in 2 nodes; slot 3 = local 1 x M + node 1: super-slice 1 = slots 2..3
    n, kk, m, k, slot = 4, 2, 2, 12, 3
    top = 2 * k
    s = np.zeros((n, k))
    for r in range(n):
        x = cases.rank_values(r, top, top + m * k).astype(dt)            # quantized from the super-slice start
        per = np.repeat([np.float32(np.abs(x[lo:lo + 8]).max()) / np.float32(127) for lo in range(0, m * k, 8)], 8)
        s[r] = per[k:2 * k]
    nodes = [s[0] + s[1], s[2] + s[3]]
    crossing = sum(np.concatenate([np.full(8, p[:8].max()), np.full(4, p[8:].max())]) for p in nodes)
    got = bq.reduce_scatter_scales(dt, n, q, slot, k, (kk, m))
    assert np.allclose(got, s.sum(axis=0) + crossing, rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype,bits", [(np.float16, 8), (np.float32, 4)])
def test_a_broken_result_or_bound_is_caught(dtype, bits):
    """The flat quantized reduce-scatter by the NumPy reference at N = 3, checked as the bench checks
    it: right and within the bound; a rank's term missing, one element off by 0.8 x D, or a bound of a
    quarter of the scale each count wrong elements."""
    n, k, q = 3, 300, Quantization(bits, 64)
    xs = [cases.rank_values(r, 0, k).astype(dtype) for r in range(n)]
    rows = [R.quantize_reference(x, bits, q.block) for x in xs]
    out = np.empty(k, dtype)
    R.dequant_sum_reference([v for v, _ in rows], [s for _, s in rows], k, bits, q.block, out, 1.0, False)
    exact, _ = cases.oracle_sum(dtype, n, 0, k)
    scales = bq.reduce_scatter_scales(dtype, n, q, 0, k)
    bound, tiny = bq.beta(n, bits, dtype), bq.slack(n, dtype)
    wrong, mx, _, _ = bq.errors(out, exact, scales, bound, tiny)
    assert wrong == 0 and 0.2 < mx <= bound
    assert bq.errors(out, exact, scales, 0.25, tiny)[0] > 0                        # a bound too tight fails
    R.dequant_sum_reference([v for v, _ in rows[:2]], [s for _, s in rows[:2]], k, bits, q.block, out, 1.0, False)
    assert bq.errors(out, exact, scales, bound, tiny)[0] > k // 2                   # rank 2's term missing
    R.dequant_sum_reference([v for v, _ in rows], [s for _, s in rows], k, bits, q.block, out, 1.0, False)
    out[7] = dtype(float(exact[7]) + 0.8 * scales[7])
    assert bq.errors(out, exact, scales, bound, tiny)[0] == 1


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--impl", "zerompi-q2"], "impl='zerompi-q2' is not allowed; use zerompi, zerompi-q8, zerompi-q4, mpi, both"),
    (["--impl", "zerompi,zerompi"], "names an implementation twice"),
    (["--impl", "zerompi-q8", "--op", "all_reduce"], "op=all_reduce has no zerompi-q8 rows"),
    (["--impl", "zerompi-q4", "--quant-block", "12"], "quant_block=12 is not allowed; use a power of two >= 8"),
    (["--impl", "zerompi-q8", "--quant-block", "4"], "quant_block=4 is not allowed"),
    (["--quant-block", "32"], "quant_block=32 applies to the quantized rows only"),
    (["--impl", "zerompi,mpi", "--quant-block", "64"], "quant_block=64 applies to the quantized rows only"),
    (["--quant-block", "x"], "--quant-block: invalid int value: 'x'"),
    (["--impl", "zerompi-q8", "--device", "gpu", "--comm", "nccl"], "impl='zerompi-q8' needs --comm mpi"),
])
def test_bad_quantized_flags(flags, needle):
    with pytest.raises(ConfigError) as e:
        bench_config.parse_config(flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_impl_lists_and_rows():
    cfg = bench_config.parse_config(["--impl", "zerompi,zerompi-q8,zerompi-q4,mpi"])
    assert cfg.impls == ("zerompi", "zerompi-q8", "zerompi-q4", "mpi") and cfg.quant_block == 64
    assert cfg.op_impls("all_reduce") == ("zerompi", "mpi") and cfg.op_impls("all_gather") == cfg.impls
    assert bench_config.parse_config([]).impls == ("zerompi", "mpi") and not bench_config.parse_config([]).quantized
    assert bench_config.parse_config(["--impl", "zerompi-q4", "--node-size", "2"]).row_impls() == \
        (levels.TWO_LEVEL, "zerompi-q4", "zerompi-2level-q4")


def test_all_reduce_with_quantized_rows_exits_2_on_every_rank():
    proc = run_mpi(2, ["-m", "zerompi.bench", "--op", "all_reduce", "--impl", "zerompi,zerompi-q8"], timeout=60,
                   check=False)
    assert proc.returncode == 2, proc.stderr
    lines = zerompi_lines(proc.stderr)     # zerompi's own lines: a launcher may add its banner
    no_python_noise(proc.stderr)
    assert len(lines) == 1 and "op=all_reduce has no zerompi-q8 rows" in lines[0] and proc.stdout == ""
