"""Sequence parallelism (--sp K, DeepSpeed-Ulysses): the SP GPT against the full one, dp x sp against pure dp
with the same global batch, stages bit-identical on a fixed mesh, all-to-all and activation bytes equal to
their formulas, the mesh's groups, the estimator and the preflight, bad input. Multi-rank cases run mpiexec
as a subprocess."""
import json

import pytest

from tests.mpirun import mpiexec, mpi_env, one_line, run_mpi, run_train
from zerompi.estimate.activations import gpt_activation_bytes
from zerompi.estimate.sp_bytes import all_to_all_bytes
from zerompi.engine.memory import theory_bytes
from zerompi.errors import ConfigError
from zerompi.train import preflight
from zerompi.train.config import parse_config

# A tiny GPT: 2 blocks, d_model 16, 4 heads, 8 tokens, 8 sequences a step (vocab 32: the generated corpus).
L, C, H, T, V, BATCH = 2, 16, 4, 8, 32, 8
GPT = ["--model", "gpt", "--n-layer", str(L), "--d-model", str(C), "--n-head", str(H), "--seq-len", str(T),
       "--batch", str(BATCH), "--eval-every", "0", "--lr", "3e-3", "--log-every", "1000", "--bucket-mb", "0.01"]
OPTIONS = {"plain": [], "clip+micro": ["--clip", "0.3", "--micro-batches", "2"]}
STEPS, SHORT = 50, 6
FP16 = ["--dtype", "fp16", "--loss-scale", "1024"]


def flags(option, stage, sp=1, tp=1, dtype="fp32", steps=STEPS, extra=()):
    dt = FP16 if dtype == "fp16" else ["--dtype", dtype]
    return GPT + OPTIONS[option] + dt + ["--steps", str(steps), "--stage", str(stage), "--sp", str(sp),
                                         "--tp", str(tp), *extra]


# ---- the model alone: one forward and backward against the full model ------------------------------
@pytest.mark.parametrize("n,tp", [(2, 1), (4, 1), (4, 2)], ids=["sp2", "sp4", "tp2-sp2"])
def test_sp_model_equals_the_full_model(n, tp):
    out = run_mpi(n, ["tests/drivers/sp_model.py", tp], timeout=120).stdout
    res = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    assert len(res) == 6, res
    for name, r in res.items():
        tol = 1e-12 if "float64" in name else 1e-5
        assert r["names"] and r["loss"] <= tol and r["grad"] <= tol, (name, r)
        assert r["bytes"] == r["formula_bytes"] > 0 and r["calls"] == r["formula_calls"], (name, r)
        if "activation_bytes" in r:        # the C kernels' workspace, measured, beside the formula in K
            assert r["activation_bytes"] == r["activation_formula"], (name, r)
    k = n // tp
    assert res["numpy-float64"]["bytes"] == 2 * L * 4 * (k - 1) * (3 * (T // k) * (C // tp) // k) * 8


# ---- training: dp x sp against pure dp (same global batch), stages bit-identical on a mesh ------------
# One launch of 4 ranks in fp32. 50 steps: pure dp (dp 4) beside dp2 x sp2, dp1 x sp4 (one with activation
# checkpointing) and dp1 x tp2 x sp2, each ZeRO stage in one of them; 6 steps: stages 0-3 on dp1 x sp4.
# Another in fp16, 6 steps, where every rank's gradients of step 2 are NaN (an injected fault on rank 1):
# stages 0-3 on dp2 x sp2 skip that step and lower the loss scale as pure dp does.
EVAL = ["--eval-every", "25"]     # the held-out loss: each SP rank evaluates its chunk of its DP rank's rows
RUNS = {
    ("dp", "plain"): flags("plain", 1, extra=EVAL), ("dp", "clip+micro"): flags("clip+micro", 2),
    ("sp2", "plain"): flags("plain", 3, sp=2), ("sp2", "clip+micro"): flags("clip+micro", 0, sp=2),
    ("sp4", "plain"): flags("plain", 2, sp=4, extra=EVAL),
    ("sp4", "clip+micro"): flags("clip+micro", 1, sp=4, extra=["--checkpoint-activations"]),
    ("tp2-sp2", "clip+micro"): flags("clip+micro", 3, sp=2, tp=2),
    ("dp", "short"): flags("clip+micro", 1, steps=SHORT),
}
RUNS.update({("sp4-stage", s): flags("clip+micro", s, sp=4, steps=SHORT) for s in range(4)})
FP16_RUNS = {("dp", "fp16"): flags("clip+micro", 1, dtype="fp16", steps=SHORT)}
FP16_RUNS.update({("sp2-fp16", s): flags("clip+micro", s, sp=2, dtype="fp16", steps=SHORT) for s in range(4)})


def train_many(configs, env=None):
    proc = run_mpi(4, ["tests/drivers/train_many.py", json.dumps(list(configs.values()))], timeout=600, env=env)
    metrics = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(metrics) == len(configs)
    return dict(zip(configs, metrics))


@pytest.fixture(scope="module")
def runs():
    import os
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_FAULT"}
    return {**train_many(RUNS, env), **train_many(FP16_RUNS, dict(env, ZEROMPI_FAULT="nan@rank1:step2"))}


def worst(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_dp_x_sp_equals_pure_dp(runs):
    for mesh in ("sp2", "sp4", "tp2-sp2"):
        for option in OPTIONS:
            if (mesh, option) not in runs:
                continue
            m, ref = runs[(mesh, option)], runs[("dp", option)]
            assert len(m["losses"]) == STEPS and worst(m["losses"], ref["losses"]) <= 1e-5, (mesh, option)
            assert m["losses"][-1] < 0.9 * m["losses"][0]          # it trains
    val, ref = runs[("sp4", "plain")]["val_losses"], runs[("dp", "plain")]["val_losses"]
    assert [s for s, _ in val] == [s for s, _ in ref] == [25, 50]
    assert worst([v for _, v in val], [v for _, v in ref]) <= 1e-5
    for s in range(4):
        assert worst(runs[("sp4-stage", s)]["losses"], runs[("dp", "short")]["losses"]) <= 1e-5
    assert sorted(runs[(mesh, o)]["stage"] for mesh, o in runs if o in OPTIONS and mesh != "dp") == [0, 1, 2, 3, 3]


def test_fp16_skips_the_same_steps_as_pure_dp(runs):
    ref = runs[("dp", "fp16")]
    assert (ref["steps_applied"], ref["loss_scale"]) == (SHORT - 1, 512)    # step 2 skipped, the scale halved
    for s in range(4):
        m = runs[("sp2-fp16", s)]
        assert (m["steps_applied"], m["loss_scale"]) == (ref["steps_applied"], ref["loss_scale"])
        # fp16 gradients are rounded per rank before the sum: another split rounds otherwise.
        assert worst(m["losses"], ref["losses"]) <= 1e-3, s


def test_stages_bit_identical_on_a_fixed_mesh(runs):
    for kind in ("sp4-stage", "sp2-fp16"):
        shas = {runs[(kind, s)]["final_params_sha256"] for s in range(4)}
        assert len(shas) == 1, kind


def test_all_to_all_activations_and_model_states_equal_formulas(runs):
    for (mesh, option), m in runs.items():
        z = m["config"]["zero"]
        sp, tp, micro = z["sp"], z["tp"], z["micro_batches"]
        if sp == 1:
            assert m["sequence_parallel"] is None
            continue
        s, dp = m["sequence_parallel"], 4 // (sp * tp)
        rows, ckpt = BATCH // dp // micro, m["config"]["checkpoint_activations"]
        want = micro * L * (3 if ckpt else 2) * 4 * (sp - 1) * (rows * (T // sp) * (C // tp) // sp) * 4
        assert s["bytes_per_step"] == s["theory_bytes_per_step"] == want, (mesh, option, s)
        assert (s["sp"], s["dp"], s["tp"], s["chunk"], s["heads_per_rank"]) == (sp, dp, tp, T // sp, H // (sp * tp))
        # The C kernels' workspace, measured (max over ranks) = the formula in K (and tp).
        act = gpt_activation_bytes(rows, T, C, L, H, V, ckpt, sp=sp, tp=tp)["total"]
        assert m["activation_bytes"] == m["activation_theory_bytes"] == act, (mesh, option)
        # ZeRO shards over the dp x sp ranks: the model states of N = 4 / tp ranks.
        isz = 2 if m["dtype"] == "fp16" else 4
        padded = m["padded_params"]
        assert m["memory_bytes"] == theory_bytes(m["stage"], padded, 4 // tp, isz, padded // (4 // tp)), (mesh, option)
    # Activations fall with K: the same rows per data-parallel rank, a quarter of the positions.
    half, quarter = (gpt_activation_bytes(4, T, C, L, H, V, sp=k)["total"] for k in (2, 4))
    assert quarter < half


def test_all_to_all_bytes_formula():
    # Per block and micro-batch: 4 all-to-alls of n C values forward (q, k, v; the output), 4 backward.
    assert all_to_all_bytes(1, 1, 4, 8, 2) == 2 * 4 * 1 * (4 * 8 // 2) * 4
    assert all_to_all_bytes(3, 2, 4, 8, 4, itemsize=8, recompute=True) == 3 * 3 * 4 * 3 * (2 * 4 * 8 // 4) * 8
    assert all_to_all_bytes(2, 5, 7, 3, 1) == 0


# ---- checkpoints: a dp x sp run is ordinary ZeRO over its dp x sp ranks --------------------------------
def test_resume_a_dp_x_sp_checkpoint_at_pure_dp(tmp_path):
    common = GPT + ["--dtype", "fp32", "--stage", "2"]
    full = run_train(4, tmp_path, *common, "--sp", "2", "--steps", "4", tag="full")
    run_train(4, tmp_path, *common, "--sp", "2", "--steps", "2", "--save-dir", tmp_path / "ck", tag="a")
    resumed = run_train(2, tmp_path, *common, "--steps", "4", "--resume", tmp_path / "ck", tag="r")
    assert resumed["first_step"] == 2 and worst(resumed["losses"], full["losses"][2:]) <= 1e-5


# ---- the mesh ----------------------------------------------------------------------------------------------
MESH_CODE = """
import json, numpy as np, zerompi
from mpi4py import MPI
w = MPI.COMM_WORLD; r = w.Get_rank()
m = zerompi.Mesh(tp=2, sp=2)
x = np.arange(2 * 2 * 2 * 3, dtype=np.float64).reshape(2, 2, 2, 3) + 100 * r    # (B, t, heads, hd)
y = m.sp_comm.all_to_all(x, 2, 1)                                              # (B, 2t, heads/2, hd)
want = np.concatenate([x[:, :, m.sp_rank:m.sp_rank + 1] - 100 * r + 100 * p for p in m.sp_ranks], axis=1)
back = m.sp_comm.all_to_all(y, 1, 2)
errors = []
for sp in (2 if r == 0 else 4, 3):
    try:
        zerompi.Mesh(tp=1, sp=sp)
        errors.append(None)
    except zerompi.ConfigError as e:
        errors.append(str(e))
rows = w.gather([r, m.tp_rank, m.sp_rank, m.dp_rank, m.tp_ranks, m.sp_ranks, m.zero_ranks, m.zero_comm.size,
                 bool(np.array_equal(y, want)), bool(np.array_equal(back, x)), m.sp_comm.bytes_sent(), errors])
if r == 0:
    print('MESH ' + json.dumps(rows), flush=True)
"""


def test_mesh_groups_all_to_all_and_disagreeing_sizes():
    out = run_mpi(8, ["-c", MESH_CODE], timeout=120).stdout
    rows = next(json.loads(line[5:]) for line in out.splitlines() if line.startswith("MESH "))
    assert len(rows) == 8
    for r, tp_rank, sp_rank, dp_rank, tp_ranks, sp_ranks, zero_ranks, zero_size, moved, back, sent, errors in rows:
        # world rank = tp_i + TP (sp_i + SP dp_i): TP groups adjacent, SP groups the TP groups around them.
        assert r == tp_rank + 2 * (sp_rank + 2 * dp_rank)
        assert tp_ranks == [r - tp_rank, r - tp_rank + 1]
        assert sp_ranks == [tp_rank + 4 * dp_rank + 2 * s for s in (0, 1)]
        assert zero_ranks == list(range(tp_rank, 8, 2)) and zero_size == 4
        assert moved and back and sent == 2 * (2 * 2 * 2 * 3 * 8 // 2)      # (K-1)/K of x each way
        assert "mesh configuration mismatch between ranks: sp = 2 on rank 0, 4 on ranks 1-7" in errors[0], errors[0]
        assert errors[1] == "sp=3 does not divide the 8 ranks; use a divisor of 8"


# ---- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,extra,needle", [
    (4, GPT + ["--sp", "3", "--n-head", "3", "--d-model", "48", "--seq-len", "9"], "sp=3 does not divide the 4 ranks"),
    (4, GPT + ["--tp", "2", "--sp", "2", "--n-head", "2"], "sp=2 does not divide the 1 heads per TP rank"),
    (2, GPT + ["--sp", "2", "--seq-len", "15"], "sp=2 does not divide seq_len=15"),
    (2, ["--model", "mlp", "--sp", "2"], "model mlp has none"),
])
def test_bad_sp_input_is_one_line_and_exit_2(n, extra, needle):
    proc = run_mpi(n, ["-m", "zerompi.train", *extra, "--steps", "2"], timeout=60, check=False)
    one_line(proc, 2, needle)


@pytest.mark.parametrize("extra,needle", [
    (["--sp", "2", "--n-head", "3", "--d-model", "48"], "sp=2 does not divide n_head=3"),
    (["--sp", "0"], "sp=0 must be a whole number of ranks >= 1"),
])
def test_bad_sp_config_is_refused_in_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(GPT + extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sp_is_taken_on_the_gpu():
    """--sp runs on the GPU's path (tests/test_gpu_path.py): the config takes it, the placement decides."""
    assert parse_config(GPT + ["--sp", "2", "--device", "gpu"]).device == "gpu"


@pytest.mark.parametrize("n,extra,needle", [
    (4, ["--sp", "4", "--node-size", "2"], "tp x sp = 4 does not divide node_size=2"),
    (4, ["--sp", "2", "--batch", "3"], "batch=3 does not split over 2 data-parallel ranks"),
])
def test_bad_sp_world_is_refused_in_one_line(n, extra, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(GPT + extra).check_world(n)
    assert needle in str(e.value)


def test_ranks_disagreeing_on_sp_stop_every_rank():
    import subprocess
    import sys
    base = [sys.executable, "-m", "zerompi.train", *GPT, "--steps", "2"]
    cmd = [mpiexec(), "-n", "1", *base, "--sp", "2", ":", "-n", "1", *base, "--sp", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=mpi_env())
    one_line(proc, 2, "mismatch", "mesh.sp = 2 on rank 0, 1 on rank 1")


# ---- the estimator and the preflight ------------------------------------------------------------------------
def test_estimator_sp_rows(capsys):
    from zerompi.estimate.cli import main
    dims = ["--n-layer", "4", "--d-model", "256", "--n-head", "8", "--seq-len", "2048", "--vocab", "32"]
    acts = {}
    for k in (1, 2, 4):
        assert main(["--ranks", "4", "--sp", str(k), "--batch", str(4 // k), "--dtype", "fp32", *dims]) == 0
        out = capsys.readouterr().out
        acts[k] = gpt_activation_bytes(1, 2048, 256, 4, 8, 32, sp=k)["total"]
        assert f"= {acts[k]:,} bytes per rank" in out
        if k > 1:
            a2a = all_to_all_bytes(4, 1, 2048 // k, 256, k)
            assert f"SP all-to-all per rank per step: {a2a:,} bytes" in out and f"{acts[k]:,} bytes without" in out
    assert acts[4] < acts[2] < acts[1]        # one sequence per data-parallel rank: activations fall with K
    assert main(["--ranks", "8", "--tp", "2", "--sp", "2", "--batch", "2", *dims]) == 0
    out = capsys.readouterr().out
    assert f"SP all-to-all per rank per step: {all_to_all_bytes(4, 1, 1024, 128, 2):,} bytes" in out
    for args, needle in ((["--ranks", "4", "--sp", "3", "--batch", "4", *dims], "sp=3 does not divide the 4 ranks"),
                         (["--ranks", "4", "--sp", "2", "--params", "1e6"], "sp=2: give the GPT's dimensions"),
                         (["--ranks", "16", "--tp", "4", "--sp", "4", "--batch", "1", *dims],
                          "sp=4 does not divide the 2 heads per TP rank")):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (args, err)


def test_preflight_counts_the_chunks_activations():
    flags_ = GPT[:4] + ["--d-model", "32", "--n-head", "4", "--seq-len", "512", "--batch", "2", "--eval-every", "0"]
    for k in (1, 2, 4):
        cfg = parse_config(flags_ + ["--sp", str(k), "--batch", str(4 // k)])
        parts = preflight.memory_needed(cfg, 4)
        assert parts["activations"] == gpt_activation_bytes(1, 512, 32, 2, 4, 32, sp=k)["total"], k
    tp = preflight.memory_needed(parse_config(flags_ + ["--sp", "2", "--tp", "2", "--batch", "1"]), 4)
    assert tp["activations"] == gpt_activation_bytes(1, 512, 32, 2, 4, 32, sp=2, tp=2)["total"]


# ---- the benchmark -------------------------------------------------------------------------------------------
def test_bench_sp_rows_beside_mpi_alltoall(tmp_path):
    path = tmp_path / "b.json"
    run_mpi(4, ["-m", "zerompi.bench", "--sp", "2", "-b", "4K", "-e", "16K", "-f", "4", "--iters", "2", "--warmup",
                "0", "--check", "--no-overlap", "--json", path], timeout=120)
    recs = json.loads(path.read_text())
    assert sorted(r["impl"] for r in recs) == ["mpi", "mpi", "zerompi-sp", "zerompi-sp"]
    for r in recs:           # every element where the layout says, bit for bit; two groups of 2 at once
        assert r["op"] == "all_to_all" and r["wrong"] == 0 and (r["sp"], r["groups"]) == (2, 2), r
        assert r["bytes"] % (3 * 2 * 64 * 4) == 0 and r["busbw"] == pytest.approx(r["algbw"] / 2)


@pytest.mark.parametrize("flags,needle", [
    (["--sp", "1"], "sp=1 makes groups of one rank: there is no all-to-all to measure"),
    (["--sp", "2", "--op", "all_reduce"], "op=all_reduce has no --sp rows"),
    (["--op", "all_to_all"], "op=all_to_all needs --sp K"),
    (["--sp", "2", "--tp", "2"], "give one of --sp and --tp"),
    (["--sp", "2", "--impl", "zerompi-q8"], "has no --sp rows"),
])
def test_bench_bad_sp_flags(flags, needle):
    from zerompi.bench.config import parse_config as bench_config
    with pytest.raises(ConfigError) as e:
        bench_config(flags)
    assert needle in str(e.value)


def test_dp_x_sp_holds_pure_dps_activations_plus_the_exchange_buffers(tmp_path):
    """docs/sequence-parallel.md: at a fixed N and global batch, dp x sp holds pure dp's activations but for the
    exchange buffers, 10nC float32 values (n: the rank's tokens), with and without checkpointing. Measured on a
    simulated rank of 4 (the default GPT: T = 64, C = 64, batch 8, so n = 2 sequences x 64 = 4 x 32 = 128)."""
    import subprocess
    import sys
    from tests.mpirun import ROOT
    got = {}
    for sp in (1, 2):
        for ckpt in ([], ["--checkpoint-activations"]):
            out = tmp_path / f"{sp}{len(ckpt)}.json"
            proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "4", "--batch", "8",
                                   "--steps", "1", "--eval-every", "0", "--progress", "lines", "--sp", str(sp), *ckpt,
                                   "--metrics-json", out], capture_output=True, text=True, timeout=240,
                                  env=mpi_env(), cwd=str(ROOT))
            assert proc.returncode == 0, proc.stderr
            got[sp, bool(ckpt)] = json.loads(out.read_text())["activation_bytes"]
    n, c = 8 // 4 * 64, 64
    for ckpt in (False, True):
        assert got[2, ckpt] - got[1, ckpt] == 4 * 10 * n * c, ckpt
