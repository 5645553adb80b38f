"""zerompi.estimate against hand-computed ZeRO figures, FlatLayout, and the engine's own accounting."""
import json
import random
import subprocess
import sys

import pytest

import zerompi
from zerompi import FlatLayout
from zerompi import estimate as est_mod
from zerompi.estimate import BucketPlan, plan_buckets
from zerompi.models.mlp import init_mlp

from .mpirun import ROOT, run_mpi, run_train

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


def test_buffers_are_rows_of_their_own():
    # 4 layers of 1024 elements in 2048-element buckets: 2 buckets; N=4 x align 16 pads nothing.
    mb = 4096 / 2 ** 20                       # 2048 fp16 elements
    r = zerompi.estimate(params=4096, ranks=4, bucket_mb=mb, layers=4, prefetch=1, micro_batches=2)
    assert r["buckets"] == 2 and r["padded_params"] == 4096
    b = [s["buffers"] for s in r["stages"]]
    # every bucket reducing at once: stage 2/3 staging = the whole 2-byte gradient, and the
    # receive scratch = the 3 peers' quarters of it
    assert b[0] == {"grad_buckets": 0, "gathered_params": 0, "grad_accumulator": 2048, "comm_scratch": 6144}
    assert b[2] == {"grad_buckets": 8192, "gathered_params": 0, "grad_accumulator": 0, "comm_scratch": 6144}
    assert b[3] == {"grad_buckets": 8192, "gathered_params": 8192, "grad_accumulator": 0, "comm_scratch": 6144}
    assert r["stages"][3]["buffer_bytes"] == 2 * 8192 + 6144
    one = zerompi.estimate(params=4096, ranks=4, bucket_mb=mb, layers=4, prefetch=0, in_flight=1)
    assert one["stages"][3]["buffers"] == {"grad_buckets": 4096, "gathered_params": 4096,
                                           "grad_accumulator": 0, "comm_scratch": 3072}


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
from zerompi.train import parse_config, train
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
        # How many reductions are pending at once depends on when MPI completes them: the
        # measured total lies between the one-pending and the all-pending figures (one bucket slack).
        bucket = max(b.numel for b in layout.buckets) * (2 if dtype == "fp16" else 4)
        best = zerompi.estimate(layout=layout, in_flight=1, **dict(kw, prefetch=0))["stages"][stage]
        total = mem["total"] + m["peak_buffer_bytes"]
        assert best["total_bytes"] - bucket <= total <= by_layout["total_bytes"] + bucket, (stage, total, best, by_layout)
        comm = m["comm_bytes_per_step"]
        if stage < 3:
            assert comm == by_layout["comm_bytes_per_step"]
        else:
            # Fewer: buckets held gathered across a forward/backward turn are not gathered again.
            # More, by up to `prefetch` buckets: a step also gathers the next step's first ones.
            gather = bucket * (n - 1) // n
            assert by_layout["comm_bytes_per_step"] - by_layout["comm_bytes_kept_at_turns"] <= comm \
                <= by_layout["comm_bytes_per_step"] + prefetch * gather, (comm, by_layout)


def test_from_run_puts_measured_beside_estimate(tmp_path, capsys):
    run_train(3, tmp_path, "--model", "mlp", "--width", WIDTH, "--depth", DEPTH, "--bucket-mb", BUCKET_MB,
              "--steps", 1, "--batch", 6, "--stage", 3, "--dtype", "fp16", tag="run")
    out = tmp_path / "cmp.json"
    assert est_mod.main(["--from-run", str(tmp_path / "run.json"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured in the run (stage 3)" in text
    cmp = json.loads(out.read_text())["from_run"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes"):
        assert cmp["measured"][key] == cmp["estimate"][key] > 0


# ---- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,word", [
    (["--params", "0", "--ranks", "4"], "params=0"),
    (["--params=-5e9", "--ranks", "4"], "params=-5e+09"),
    (["--params", "ten", "--ranks", "4"], "--params: 'ten' is not a number"),
    (["--params", "1e9", "--ranks", "0"], "ranks=0"),
    (["--params", "1e9", "--ranks", "4", "--dtype", "bf16"], "dtype='bf16'"),
    (["--params", "1e9", "--ranks", "4", "--layers", "4", "--largest-layer", "10"], "not allowed with"),
    (["--params", "100", "--ranks", "4", "--largest-layer", "1000"], "largest_layer=1000"),
    (["--params", "1e9", "--ranks", "4", "--bucket-mb", "0"], "bucket_mb=0"),
    (["--ranks", "4"], "--params"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, word):
    assert est_mod.main(argv) == 2
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
