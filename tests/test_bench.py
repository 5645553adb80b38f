"""``python -m zerompi.bench``: --check finds no wrong element, the records add up, bad flags exit 2."""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, one_line, run_mpi
from zerompi.bench import cases as bench_cases, config as bench_config, records as bench_records, run as bench
from zerompi.errors import ConfigError

# 999 B: no size divides by N
SMALL = ["-b", "999", "-e", "20K", "-f", "5", "--iters", "1", "--warmup", "0", "--check"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_check_finds_no_wrong_element(n, tmp_path):
    """Every op, both dtypes, both implementations; sizes padded to whole slices."""
    for dtype in ("fp16", "fp32"):
        path = tmp_path / f"{dtype}.json"
        run_mpi(n, ["-m", "zerompi.bench", "--op", "all", "--dtype", dtype, "--impl", "both", "--no-overlap",
                    "--json", path, *SMALL], timeout=90)
        records = json.loads(path.read_text())
        assert ({(r["op"], r["impl"]) for r in records}
                == {(op, impl) for op in bench_config.OPS for impl in bench_config.IMPLS})
        assert len(records) == 3 * 2 * 2                       # ops x impls x sizes (999, 4995)
        for r in records:
            assert r["wrong"] == 0, r
            assert r["dtype"] == dtype and r["ranks"] == n
            assert r["bytes"] >= 999 and (r["bytes"] // np.dtype(bench.DTYPES[dtype]).itemsize) % n == 0
            assert r["busbw"] == pytest.approx(r["algbw"] * bench_records.bus_factor(r["op"], n))
            assert r["algbw"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
            assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]


def test_table_footer_and_overlap(tmp_path):
    """The default run's shape: one table per op, both implementations, overlap in [0, 100], footer."""
    path = tmp_path / "b.json"
    proc = run_mpi(2, ["-m", "zerompi.bench", "-b", "64K", "-e", "64K", "--iters", "2", "--warmup", "1",
                       "--dtype", "fp16", "--json", path], timeout=90)
    records = json.loads(path.read_text())
    for r in records:
        has_overlap = not (r["impl"] == "zerompi" and r["op"] == "all_reduce")
        assert (r["overlap_pct"] is not None) == has_overlap, r
        if has_overlap:
            assert 0.0 <= r["overlap_pct"] <= 100.0 and r["t_pure_us"] > 0
        assert r["wrong"] is None and r["copy_GBps"] > 0
        # MPI has no fp16 sum: its reduce rows move fp32 elements of the same byte size
        float_star = r["impl"] == "mpi" and r["op"] != "all_gather"
        assert r["type"] == ("float*" if float_star else "half")
        assert r["count"] == r["bytes"] // (4 if float_star else 2)
    out = proc.stdout
    assert out.count("# reduce_scatter:") == out.count("# all_gather:") == out.count("# all_reduce:") == 1
    assert "# Avg bus bandwidth  zerompi:" in out and "# Avg bus bandwidth      mpi:" in out
    assert "# Copy bandwidth of the same buffers" in out and "float*: MPI has no fp16 sum" in out
    assert "reduce_scatter busbw zerompi/mpi" not in out      # only for sizes >= 1 MiB


BAD = [
    (["-b", "64M", "-e", "1M"], "larger than max size"),
    (["--op", "broadcast"], "op='broadcast'"),
    (["--dtype", "bf16"], "dtype='bf16'"),
    (["-b", "0"], "size '0'"),
    (["-e", "0K"], "size '0K'"),
    (["-f", "1"], "factor=1"),
    (["-f", "0.5"], "factor=0.5"),
    (["-b", "12Q"], "size '12Q'"),
    (["--impl", "nccl"], "impl='nccl'"),
    (["--iters", "0"], "iters=0"),
    (["--device", "tpu"], "device='tpu'"),
    (["--sum-impl", "fast"], "sum_impl='fast'"),
]


@pytest.mark.parametrize("flags,needle", BAD)
def test_bad_flags_raise_config_error(flags, needle):
    with pytest.raises(ConfigError) as e:
        bench.parse_config(flags)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.every_mpi
@pytest.mark.parametrize("flags,needle", [(["-b", "64M", "-e", "1M"], "larger than max size"),
                                          (["--op", "broadcast"], "op='broadcast'"),
                                          (["--device", "gpu"], "device='gpu'")])
def test_bad_flags_exit_2_on_every_rank(flags, needle):
    proc = run_mpi(3, ["-m", "zerompi.bench", *flags], timeout=60, check=False)
    assert one_line(proc, 2, needle).startswith("zerompi.bench: error: ")
    assert proc.stdout == ""


def test_parse_size_and_sizes():
    assert bench_config.parse_size("8K") == 8192 and bench_config.parse_size("64M") == 64 << 20
    assert bench_config.parse_size("1G") == 1 << 30 and bench_config.parse_size("4096") == 4096
    assert bench_config.parse_size("2MiB") == 2 << 20 and bench_config.parse_size("1.5k") == 1536
    cfg = bench.parse_config(["-b", "1M", "-e", "64M", "-f", "4"])
    assert cfg.sizes() == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert bench.parse_config(["-b", "3", "-e", "3"]).sizes() == [3]
    assert bench.parse_config(["--op", "all_gather"]).ops == ("all_gather",)
    assert bench.parse_config(["--impl", "mpi"]).impls == ("mpi",)


def test_padding_and_factors():
    assert bench_records.padded_count(999, 4, 3) == 252          # 250 elements -> whole slices of 84
    assert bench_records.padded_count(999, 2, 3) == 504          # fp16: 2N, so the fp32 view splits too
    assert bench_records.padded_count(1, 4, 4) == 4
    assert bench_records.bus_factor("all_reduce", 4) == 1.5 and bench_records.bus_factor("reduce_scatter", 4) == 0.75
    assert bench_records.bus_factor("all_gather", 1) == 0.0


def test_wrong_counter_and_overlap_formula():
    """count_wrong flags one bad element, NaN, and any all-gather bit difference."""
    n, size = 3, 500
    want, mag = bench_cases.oracle_sum(np.float16, n, 0, size)
    got = want.astype(np.float16)
    assert bench_cases.count_wrong(got, want, mag, n) == 0
    x2 = bench_cases.rank_values(2, 0, size).astype(np.float16)
    i = int(np.argmax(np.abs(x2)))
    got[i] -= x2[i]                                       # rank 2's term missing
    got[0] = np.nan
    assert bench_cases.count_wrong(got, want, mag, n) == 2
    exact = bench_cases.rank_values(1, 10, 20).astype(np.float32)
    assert bench_cases.count_wrong(exact, exact.astype(np.float64), None, n) == 0
    assert bench_cases.count_wrong(exact + np.float32(1e-7), exact.astype(np.float64), None, n) > 0
    assert np.array_equal(bench_cases.rank_values(1, 10, 20), bench_cases.rank_values(1, 0, 30)[10:20])
    assert bench_cases.overlap_pct(10.0, 10.0, 10.0) == 100.0   # communication fully hidden
    assert bench_cases.overlap_pct(10.0, 10.0, 20.0) == 0.0     # none hidden
    assert bench_cases.overlap_pct(10.0, 10.0, 15.0) == pytest.approx(50.0)


@pytest.mark.parametrize("n,dtype", [(1, "fp32"), (3, "fp16"), (4, "fp32")])
def test_device_rows_run_the_staged_communicator(n, dtype):
    """--device gpu's wiring, run on the CPU: zerompi rows through the staged Communicator on
    separate "device" copies, every op, sizes not divisible by N; nothing wrong."""
    proc = run_mpi(n, [ROOT / "tests" / "drivers" / "bench_staged.py", "--op", "all", "-b", "1000", "-e", "70000",
                       "-f", "8", "--dtype", dtype], timeout=120)
    out = json.loads(proc.stdout.splitlines()[-1])
    zerompi_rows = [r for r in out["records"] if r["impl"] == "zerompi"]
    assert len(zerompi_rows) == 3 * 3 and all(r["wrong"] == 0 for r in out["records"]), out["records"]
    assert out["staged"]["to_host_bytes"] > 0 and out["staged"]["to_device_bytes"] > 0
