"""zerompi.estimate against hand-computed ZeRO figures, FlatLayout, and the engine's own accounting."""
import json
import random
import subprocess
import sys

import numpy as np
import pytest

import zerompi
from zerompi import FlatLayout, ZeroConfig, ZeroEngine
from zerompi.estimate import cli as estimate_cli
from zerompi.engine.reducer import MAX_PENDING_REDUCES
from zerompi.estimate.plan import BucketPlan, plan_buckets
from zerompi.train.models.mlp import init_mlp

from .mpirun import ROOT, run_mpi, run_train
from .test_overlap import FakeComm

GB = 10 ** 9
WIDTH, DEPTH, BUCKET_MB = 20, 3, 0.002   # 420-element layers; fp16 buckets hold 2 layers, fp32 buckets 1


# ---- the classic example, by hand ------------------------------------------------------

def test_ten_billion_on_64_ranks_fp16():
    psi, n = 10 ** 10, 64
    rows = zerompi.estimate(params=10e9, ranks=64)["stages"]
    # DESIGN.md's table worked by hand: 2-byte params and grads, 12 bytes of fp32 master + m + v.
    want = [(2 * psi, 2 * psi, 12 * psi), (2 * psi, 2 * psi, 12 * psi // n),
            (2 * psi, 2 * psi // n, 12 * psi // n), (2 * psi // n, 2 * psi // n, 12 * psi // n)]
    for row, (p, g, o) in zip(rows, want):
        assert (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"]) == (p, g, o)
        assert row["model_state_bytes"] == p + g + o
        assert row["total_bytes"] == p + g + o + row["buffer_bytes"]
    assert [r["model_state_bytes"] for r in rows] == [160 * GB, 41.875 * GB, 22.1875 * GB, 2.5 * GB]


def test_fp32_keeps_4_byte_params_and_grads():
    psi, n = 10 ** 10, 64
    rows = zerompi.estimate(params=psi, ranks=n, dtype="fp32")["stages"]
    assert [r["model_state_bytes"] for r in rows] == [20 * psi, 8 * psi + 12 * psi // n,
                                                      4 * psi + 16 * psi // n, 20 * psi // n]


def test_cli_prints_the_answer_first(tmp_path):
    out = tmp_path / "e.json"
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "zerompi.estimate",
                           "--params", "10e9", "--ranks", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("model states, GB"))
    assert row < 7, "the model-state answer must be the first thing on the screen"
    assert lines[row].split()[-4:] == ["160.0000", "41.8750", "22.1875", "2.5000"]
    assert lines[row + 1].strip().startswith("model states, GiB")
    assert lines[row + 1].split()[-1] == f"{2.5e9 / 2 ** 30:.4f}"
    data = json.loads(out.read_text())
    keys = {"stage", "model_state_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "buffer_bytes",
            "total_bytes", "comm_bytes_per_step"}
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    assert all(keys <= set(s) for s in data["stages"])
    assert data["stages"] == zerompi.estimate(params=10e9, ranks=64)["stages"]
    # the default is the engine's own cap on pending reductions, and the footer says so
    assert data["in_flight"] == data["engine_max_pending"] == MAX_PENDING_REDUCES
    assert f"at most {MAX_PENDING_REDUCES}: the engine's cap" in proc.stdout
    assert "no bound" not in proc.stdout


def test_default_follows_the_engine_cap(monkeypatch):
    # Read from engine/zero_engine.py when the estimate is made: a different cap gives a different figure.
    kw = dict(params=8192, ranks=4, bucket_mb=4096 / 2 ** 20, layers=8)
    at_two = zerompi.estimate(**kw)
    assert at_two == zerompi.estimate(in_flight=2, **kw)
    monkeypatch.setattr(zerompi.engine.reducer, "MAX_PENDING_REDUCES", 1)
    at_one = zerompi.estimate(**kw)
    assert at_one["in_flight"] == 1 and at_one == zerompi.estimate(in_flight=1, **kw)
    assert at_one["stages"][2]["total_bytes"] < at_two["stages"][2]["total_bytes"]


def test_buffers_are_rows_of_their_own():
    # 8 layers of 1024 elements in 2048-element buckets: 4 buckets; N=4 x align 16 pads nothing.
    mb = 4096 / 2 ** 20                       # 2048 fp16 elements = 4096 bytes a bucket
    r = zerompi.estimate(params=8192, ranks=4, bucket_mb=mb, layers=8, prefetch=1, micro_batches=2)
    assert r["buckets"] == 4 and r["padded_params"] == 8192 and r["in_flight"] == 2
    b = [s["buffers"] for s in r["stages"]]
    # The engine's cap: 2 reductions pending while a third bucket fills, so stages 2/3 stage
    # 3 of the 4 buckets (3 x 4096 bytes); the Communicator keeps a receive buffer per
    # reduction in flight: 2 x the 3 peers' quarters of a bucket (2 x 3072). One bucket
    # length, so spare buffers are always reused and add nothing.
    assert b[0] == {"grad_buckets": 0, "gathered_params": 0, "spare_buffers": 0, "grad_accumulator": 2 * 2048,
                    "comm_scratch": 2 * 3072}
    assert b[2] == {"grad_buckets": 3 * 4096, "gathered_params": 0, "spare_buffers": 0, "grad_accumulator": 0,
                    "comm_scratch": 2 * 3072}
    # stage 3 also holds the bucket in use and the one prefetched
    assert b[3] == {"grad_buckets": 3 * 4096, "gathered_params": 2 * 4096, "spare_buffers": 0,
                    "grad_accumulator": 0, "comm_scratch": 2 * 3072}
    assert r["stages"][3]["buffer_bytes"] == 5 * 4096 + 2 * 3072
    # best case: none pending when a bucket fills, so one staged bucket and one receive buffer
    assert r["stages"][3]["buffer_bytes_best_case"] == 4096 + 2 * 4096 + 3072
    assert r["stages"][3]["total_bytes_best_case"] == r["stages"][3]["total_bytes_one_in_flight"] \
        == r["stages"][3]["model_state_bytes"] + 4096 + 2 * 4096 + 3072
    one = zerompi.estimate(params=8192, ranks=4, bucket_mb=mb, layers=8, prefetch=0, in_flight=1)
    assert one["stages"][3]["buffers"] == {"grad_buckets": 2 * 4096, "gathered_params": 4096, "spare_buffers": 0,
                                           "grad_accumulator": 0, "comm_scratch": 3072}
    # no cap at all (an engine without one): the whole gradient staged, every bucket's scratch
    unbounded = zerompi.estimate(params=8192, ranks=4, bucket_mb=mb, layers=8, in_flight=100)
    assert unbounded["stages"][2]["buffers"]["grad_buckets"] == 2 * 8192
    assert unbounded["stages"][2]["buffers"]["comm_scratch"] == 4 * 3072


def test_spare_buffers_of_another_length_add_up():
    # 2048-element layers and a 1024-element rest: buckets of 2048, 2048, 2048, 2048 and 1024.
    mb = 4096 / 2 ** 20
    r = zerompi.estimate(params=9216, ranks=4, bucket_mb=mb, largest_layer=2048, prefetch=1)
    assert r["buckets"] == 5
    s2, s3 = (r["stages"][i]["buffers"] for i in (2, 3))
    # The short bucket is served by a 2048-element buffer (its class): a class of its own would
    # keep its staging (and, stage 3, gathered) buffer spare beside 3 staged (+ 2 gathered)
    # 2048-element ones, 1024 (2 x 1024) elements more than the live buffers. Sharing, the
    # pool holds just the live count of the largest length: no spare row.
    assert (s2["grad_buckets"], s2["spare_buffers"]) == (3 * 4096, 0)
    assert (s3["grad_buckets"], s3["gathered_params"], s3["spare_buffers"]) == (3 * 4096, 2 * 4096, 0)
    # the receive pool keeps buffers per length: 2 of the long length, 1 of the short one
    assert s3["comm_scratch"] == (2 * 2048 + 1024) * 2 * 3 // 4
    # A long bucket among short ones keeps a class of its own: 2 of it (staged and gathered)
    # beside 3 + 2 short ones cost less than 5 long ones. The live rows take the largest
    # buckets (3 staged: the long one and 2 short; 2 gathered: the long one and 1 short), so
    # the spares are the other 2 short buffers (fp16 bytes).
    lay = FlatLayout([(f"l{i}", [(f"p{i}", (n,))]) for i, n in enumerate([2048] * 4 + [4096])], 4, 2048, 16)
    b3 = zerompi.estimate(layout=lay, bucket_mb=mb, prefetch=1)["stages"][3]["buffers"]
    assert (b3["grad_buckets"], b3["gathered_params"]) == (2 * (4096 + 2 * 2048), 2 * (4096 + 2048))
    assert b3["spare_buffers"] == 2 * (2 * 4096 + 5 * 2048) - b3["grad_buckets"] - b3["gathered_params"] == 2 * 2 * 2048


def _layers(sizes):
    rng = np.random.default_rng(3)
    return [(f"l{i}", {f"w{i}": rng.standard_normal(n).astype(np.float32)}) for i, n in enumerate(sizes)]


# Elements the engine's bucket buffers hold at their peak, by hand, for each layout, timing and
# stage. Staged = pending + 1 (2 + 1 slow, 0 + 1 otherwise); gathered = 1 + prefetch (1 with
# overlap off). The pool's classes are sized for the cap (3 staged, 2 gathered; 1 and 1 with
# overlap off): "long-last" keeps its 32-element bucket in a class of its own with overlap on
# (2 x 32 + 5 x 16 beats 5 x 32), so every buffer of it that was ever live stays beside the
# 16-element ones; with overlap off one class of 32 serves both (2 x 32 < 2 x 32 + 2 x 16).
# "short-last" always serves its 16-element bucket from a 32-element buffer (no spare row).
REACHED = {
    "long-last": {("slow", 2): 32 + 16 * 3, ("fast", 2): 32 + 16, ("no-overlap", 2): 32,
                  ("slow", 3): (16 * 3 + 32) + (16 * 2 + 32), ("fast", 3): (16 + 32) + (16 * 2 + 32),
                  ("no-overlap", 3): 32 + 32},
    "short-last": {("slow", 2): 3 * 32, ("fast", 2): 32, ("no-overlap", 2): 32,
                   ("slow", 3): 5 * 32, ("fast", 3): 3 * 32, ("no-overlap", 3): 2 * 32},
}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("timing", ["slow", "fast", "no-overlap"])
@pytest.mark.parametrize("layout", ["long-last", "short-last"])
def test_engine_reaches_the_estimate(layout, stage, timing):
    # One rank, a fake MPI whose collectives complete at their `latency`-th test: 100 tests
    # is a network so slow that only the cap's waits retire reductions (the estimate must be
    # reached exactly), 1 test is one that keeps up (the best case must be reached exactly).
    # fp32 buckets of one layer each: 16, 16, 16, 16 and 32 elements, or 32, 32, 32, 32 and 16.
    sizes, bucket = ([16, 16, 16, 16, 32], 16) if layout == "long-last" else ([32, 32, 32, 32, 16], 32)
    cfg = ZeroConfig(stage=stage, dtype="fp32", bucket_mb=bucket * 4 / 2 ** 20, prefetch=1,
                     overlap=timing != "no-overlap")
    eng = ZeroEngine(_layers(sizes), cfg, FakeComm(latency=1 if timing == "fast" else 100))
    assert [b.numel for b in eng.layout.buckets] == sizes
    n = len(sizes)
    for _ in range(2):
        eng.begin_forward()
        for i in range(n):
            with eng.unsharded(i):
                pass
        eng.begin_backward()
        for i in reversed(range(n)):
            with eng.unsharded(i):
                pass
            eng.grads_ready(i, {f"w{i}": np.full(sizes[i], 0.01, np.float32)})
        assert not eng.step().skipped
    peak = eng.memory_report()["peak_buffers"]["bytes"]
    eng.close()
    row = zerompi.estimate(layout=eng.layout, dtype="fp32", prefetch=1, overlap=cfg.overlap)["stages"][stage]
    figure = row["buffer_bytes"] if timing == "slow" else row["buffer_bytes_best_case"]
    assert peak == figure == 4 * REACHED[layout][timing, stage], (peak, row)


def test_communication_volumes_and_alpha_beta_time():
    psi, n = 4096, 4
    mb = 4096 / 2 ** 20
    r = zerompi.estimate(params=psi, ranks=n, bucket_mb=mb, layers=4, bandwidth_gbps=8.0, latency_us=10.0)
    one_pass = 2 * psi * (n - 1) // n         # fp16 bytes a rank sends in one ring pass
    assert [s["comm_bytes_per_step"] for s in r["stages"]] == [2 * one_pass] * 3 + [3 * one_pass]
    s3 = r["stages"][3]
    assert s3["comm_calls_per_step"] == 6     # 2 buckets x (gather fwd, gather bwd, reduce-scatter)
    assert s3["comm_seconds_per_step"] == pytest.approx(6 * 3 * 10e-6 + 3 * one_pass * 8 / 8e9)
    assert zerompi.estimate(params=psi, ranks=1)["stages"][2]["comm_seconds_per_step"] == 0.0


# ---- the layout of a big model, against FlatLayout ----------------------------------------

def test_plan_equals_flatlayout():
    rng = random.Random(7)
    for _ in range(300):
        psi, n, cap, align = rng.randint(1, 300), rng.randint(1, 5), rng.randint(1, 100), rng.choice([1, 4, 16])
        mode = rng.choice(["layers", "largest", "fill"])
        if mode == "layers":
            count = rng.randint(1, psi)
            small, extra = divmod(psi, count)
            sizes, kw = [small + 1] * extra + [small] * (count - extra), {"layers": count}
        else:
            size = rng.randint(1, psi) if mode == "largest" else min(cap, psi)
            sizes = [size] * (psi // size) + ([psi % size] if psi % size else [])
            kw = {"largest_layer": size} if mode == "largest" else {}
        layout = FlatLayout([(f"l{i}", [(f"p{i}", (s,))]) for i, s in enumerate(sizes)], n, cap, align)
        assert plan_buckets(psi, n, cap, align=align, **kw) == BucketPlan.from_layout(layout), (psi, n, cap, align, kw)


# ---- the engine's own accounting ---------------------------------------------------------

# One mpiexec launch trains every stage in turn (launches dominate the time of these tiny runs).
EVERY_STAGE = """
import sys
from zerompi.errors import install_abort_hook
from zerompi.train.config import parse_config
from zerompi.train.run import train
install_abort_hook()
out, flags = sys.argv[1], sys.argv[2:]
for stage in range(4):
    train(parse_config(flags + ["--stage", str(stage), "--metrics-json", f"{out}/s{stage}.json"]))
"""


def mlp_layout(n, dtype):
    spec = [(name, [(p, a.shape) for p, a in params.items()]) for name, params in init_mlp(WIDTH, DEPTH, 0)]
    itemsize = 2 if dtype == "fp16" else 4
    return FlatLayout(spec, n, int(BUCKET_MB * 2 ** 20) // itemsize, 16)


@pytest.mark.parametrize("dtype,micro", [("fp16", 1), ("fp32", 2)])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_estimate_matches_the_engine(tmp_path, n, dtype, micro):
    layout = mlp_layout(n, dtype)
    run_mpi(n, ["-c", EVERY_STAGE, tmp_path, "--model", "mlp", "--width", WIDTH, "--depth", DEPTH,
                "--bucket-mb", BUCKET_MB, "--steps", 2, "--batch", 24, "--dtype", dtype, "--micro-batches", micro])
    for stage in range(4):
        m = json.loads((tmp_path / f"s{stage}.json").read_text())
        assert (m["stage"], m["world_size"], m["dtype"]) == (stage, n, dtype)
        assert m["padded_params"] == layout.numel
        prefetch = m["config"]["zero"].get("prefetch", 0) if m["config"]["zero"].get("overlap", True) else 0
        kw = dict(dtype=dtype, bucket_mb=BUCKET_MB, micro_batches=micro, prefetch=prefetch)
        by_layout = zerompi.estimate(layout=layout, **kw)["stages"][stage]
        by_shape = zerompi.estimate(params=m["params"], ranks=n, layers=DEPTH, **kw)["stages"][stage]
        mem = m["memory_bytes"]
        measured = {"params_bytes": mem["params"], "grads_bytes": mem["grads"],
                    "optimizer_bytes": mem["optimizer"], "model_state_bytes": mem["total"]}
        for row in (by_layout, by_shape):
            assert {k: row[k] for k in measured} == measured, (stage, row, measured)
        # How many reductions are pending at once depends on when MPI completes them, but
        # never more than the engine's cap: the measured total is at most the estimate, with
        # no slack. The best case (none pending when a bucket fills) is reached whatever the
        # timing by these layouts: fp16 has 2 buckets, both always staged or spare and (stage
        # 3) both gathered at the backward's start; fp32 has 3 buckets of one length, and
        # stage 3 gathers 2 of them while the first is staged. (For fp16 the two coincide.)
        assert by_shape["total_bytes"] == by_layout["total_bytes"]
        total = mem["total"] + m["peak_buffer_bytes"]
        assert by_layout["total_bytes_best_case"] <= total <= by_layout["total_bytes"], (stage, total, by_layout)
        comm = m["comm_bytes_per_step"]
        if stage < 3:
            assert comm == by_layout["comm_bytes_per_step"]
        else:
            # Fewer: buckets held gathered across a forward/backward turn are not gathered again.
            # More, by up to `prefetch` buckets: a step also gathers the next step's first ones.
            bucket = max(b.numel for b in layout.buckets) * (2 if dtype == "fp16" else 4)
            gather = bucket * (n - 1) // n
            assert by_layout["comm_bytes_per_step"] - by_layout["comm_bytes_kept_at_turns"] <= comm \
                <= by_layout["comm_bytes_per_step"] + prefetch * gather, (comm, by_layout)


def test_from_run_puts_measured_beside_estimate(tmp_path, capsys):
    run_train(3, tmp_path, "--model", "mlp", "--width", WIDTH, "--depth", DEPTH, "--bucket-mb", BUCKET_MB,
              "--steps", 1, "--batch", 6, "--stage", 3, "--dtype", "fp16", tag="run")
    out = tmp_path / "cmp.json"
    assert estimate_cli.main(["--from-run", str(tmp_path / "run.json"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured in the run (stage 3)" in text and "best case" in text
    cmp = json.loads(out.read_text())["from_run"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes"):
        assert cmp["measured"][key] == cmp["estimate"][key] > 0
    assert cmp["estimate_best_case"]["total_bytes"] <= cmp["measured"]["total_bytes"] \
        <= cmp["estimate"]["total_bytes"], cmp
    assert cmp["estimate_one_in_flight"] == cmp["estimate_best_case"]


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,word", [
    (["--params", "0", "--ranks", "4"], "params=0"),
    (["--params=-5e9", "--ranks", "4"], "params=-5e+09"),
    (["--params", "ten", "--ranks", "4"], "--params: 'ten' is not a number"),
    (["--params", "1e9", "--ranks", "0"], "ranks=0"),
    (["--params", "1e9", "--ranks", "4", "--dtype", "fp8"], "dtype='fp8'"),
    (["--params", "1e9", "--ranks", "4", "--layers", "4", "--largest-layer", "10"], "not allowed with"),
    (["--params", "100", "--ranks", "4", "--largest-layer", "1000"], "largest_layer=1000"),
    (["--params", "1e9", "--ranks", "4", "--bucket-mb", "0"], "bucket_mb=0"),
    (["--params", "1e9", "--ranks", "4", "--in-flight", "-1"], "in_flight=-1"),
    (["--params", "1e9", "--ranks", "4", "--in-flight", "2", "--no-overlap"], "overlap off"),
    (["--ranks", "4"], "--params"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, word):
    assert estimate_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerompi.estimate: error:") and word in err, err


def test_bad_input_exit_status_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--params", "1e9", "--ranks", "-3"],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "zerompi.estimate: error: ranks=-3 must be an integer >= 1"


def test_python_api_raises_config_error():
    with pytest.raises(zerompi.ConfigError, match="dtype='fp8'"):
        zerompi.estimate(params=1e9, ranks=8, dtype="fp8")
    with pytest.raises(zerompi.ConfigError, match="params=0"):
        zerompi.estimate(params=0, ranks=8)


# ---- the package: callable --------------------------------------------------------------

def test_package_is_callable_and_calls_the_estimate():
    from zerompi.estimate import stages
    assert zerompi.estimate(params=1e9, ranks=8) == stages.estimate(params=1e9, ranks=8)
