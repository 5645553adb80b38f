"""Tensor parallelism (--tp K): the TP models against the full ones, dp x tp against pure dp with the
same global batch, stages bit-identical on a fixed mesh, TP bytes and model-state memory equal to
their formulas, checkpoints per TP rank, bad input. Multi-rank cases run mpiexec as a subprocess."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, no_python_noise, one_line, run_mpi, run_train, zerompi_lines
from zerompi.comm.tp_pieces import merge, piece
from zerompi.engine.memory import theory_bytes, theory_comm_bytes
from zerompi.estimate.activations import gpt_activation_bytes
from zerompi.estimate.tp_bytes import gpt_tp

# The GPT: 2 blocks, d_model 32, 4 heads, 16 tokens; the MLP: width 32, depth 4. 50 steps, fp32.
GPT = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "0", "--lr", "3e-3"]
MLP = ["--model", "mlp", "--width", "32", "--depth", "4", "--batch", "16", "--lr", "1e-2"]
MODELS = {"gpt": GPT, "mlp": MLP}
OPTIONS = {"plain": [], "clip+micro": ["--clip", "0.3", "--micro-batches", "2"]}
STEPS = 50


def flags(model, option, stage, dtype="fp32", steps=STEPS, tp=1):
    return (MODELS[model] + OPTIONS[option] + ["--steps", str(steps), "--dtype", dtype, "--stage", str(stage),
                                               "--tp", str(tp), "--log-every", "1000", "--bucket-mb", "0.02"])


def train_many(n, configs, timeout=600):
    proc = run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=timeout)
    return [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]


def key(m):
    z = m["config"]["zero"]
    return (m["model"], "plain" if z["clip"] == 0 else "clip+micro", m["dtype"])


# ---- the models alone: one forward and backward against the full model -----------------------------
@pytest.mark.parametrize("k", [2, 4])
def test_tp_models_equal_the_full_models(k):
    out = run_mpi(k, ["tests/drivers/tp_model.py"], timeout=120).stdout
    res = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    T, L, C, B = 8, 2, 16, 3                 # the driver's sizes (vocab 11 plays no part here)
    for name, r in res.items():
        assert r["names"] and r["replicated_identical"], (name, r)
        tol = 1e-12 if name == "gpt-float64" else 1e-5
        assert r["loss"] <= tol and r["grad"] <= tol, (name, r)
    # TP all-reduces of one micro-batch: 2 forward + 2 backward per block of B*T*C values, 2(K-1)/K of each sent.
    for dtype, isz in (("float64", 8), ("float32", 4)):
        r = res[f"gpt-{dtype}"]
        assert r["calls"] == 4 * L and r["bytes"] == 4 * L * 2 * (k - 1) * (B * T * C // k) * isz, r
        # The C kernels, as every mode runs them: the workspace's activations equal the formula in tp (with
        # checkpointing too); checkpointing runs each block's 2 forward all-reduces again and gives the same bits.
        assert r["kernels"] == "c" and r["checkpoint_same_bits"] and r["driven_same_bits"], r
        for name in ("activations", "activations-ckpt"):
            assert r[name][0] == r[name][1] > 0, (name, r)
        assert r["activations-ckpt"][0] < r["activations"][0] and r["calls-ckpt"] == 6 * L, r
    r = res["mlp-float32"]     # depth 4: forward after blocks 1, 3; backward on block 2's input gradient
    assert r["calls"] == 3 and r["bytes"] == 3 * 2 * (k - 1) * (6 * 16 // k) * 4, r


def test_piece_and_merge_are_inverse_and_keep_heads_together():
    full = np.arange(4 * 12).reshape(4, 12)          # q | k | v columns, 4 each
    pieces = [piece(full, 1, 3, r, 2) for r in range(2)]
    assert pieces[0][:, :2].tolist() == full[:, 0:2].tolist() and pieces[0][:, 2:4].tolist() == full[:, 4:6].tolist()
    assert np.array_equal(merge(pieces, 1, 3), full)
    assert np.array_equal(merge([piece(full, 0, 1, r, 4) for r in range(4)], 0, 1), full)


# ---- training: dp x tp against pure dp, every stage ---------------------------------------------------
def runs_for(n, tp):
    configs = [flags(m, o, s, tp=tp) for m in MODELS for o in OPTIONS for s in range(4)]
    configs += [flags("gpt", "clip+micro", s, "fp16", steps=10, tp=tp) for s in range(4)]
    return train_many(n, configs)


@pytest.fixture(scope="module", params=[(1, 2), (2, 2)], ids=["dp1-tp2", "dp2-tp2"])
def tp_runs(request):
    dp, tp = request.param
    baseline = train_many(dp, [flags(m, o, 1) for m in MODELS for o in OPTIONS])
    results = runs_for(dp * tp, tp)
    assert len(baseline) == 4 and len(results) == 20
    return dp, tp, {key(m): m for m in baseline}, results


def test_dp_x_tp_equals_pure_dp(tp_runs):
    dp, tp, baseline, results = tp_runs
    for m in results:
        if m["dtype"] != "fp32":
            continue
        ref = baseline[key(m)]["losses"]
        got = m["losses"]
        assert len(got) == len(ref) == STEPS
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        assert worst <= 1e-5, (key(m), m["stage"], worst)
        assert m["losses"][-1] < m["losses"][0] * 0.9          # it trains
        assert m["tensor_parallel"]["tp"] == tp and m["tensor_parallel"]["dp"] == dp


def test_stages_bit_identical_on_a_fixed_mesh(tp_runs):
    _, _, _, results = tp_runs
    groups = {}
    for m in results:
        groups.setdefault(key(m), {})[m["stage"]] = m["final_params_sha256"]
    assert len(groups) == 5
    for k, shas in groups.items():
        assert sorted(shas) == [0, 1, 2, 3] and len(set(shas.values())) == 1, (k, shas)
    assert len({next(iter(s.values())) for s in groups.values()}) == 5


def test_tp_bytes_memory_and_dp_traffic_equal_formulas(tp_runs):
    dp, tp, _, results = tp_runs
    for m in results:
        z, t = m["config"]["zero"], m["tensor_parallel"]
        micro, isz = z["micro_batches"], 4 if m["dtype"] == "fp32" else 2
        if m["model"] == "gpt":
            rows, T, C, L = 8 // dp // micro, 16, 32, 2
            # Parameters: split ones (qkv, proj.w, fc, out.w) cut K ways; embeddings, LayerNorms, proj.b, out.b whole.
            split = L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C)
            whole = 32 * C + 16 * C + L * (6 * C) + 2 * C      # vocab 32 (the generated corpus), positions 16
            want_tp = micro * L * 4 * 2 * (tp - 1) * (rows * T * C // tp) * 4
        else:
            rows, W = 16 // dp // micro, 32
            split = 4 * W * W + 2 * W                           # every weight, the column-parallel biases
            whole = 2 * W                                       # the row-parallel biases
            want_tp = micro * 3 * 2 * (tp - 1) * (rows * W // tp) * 4
        assert t["bytes_per_step"] == t["theory_bytes_per_step"] == want_tp, (key(m), t)
        assert t["params_local"] == whole + split // tp and m["params"] == t["params_total"]   # params: the whole
        if m["model"] == "gpt":     # the estimator, from the dimensions alone
            est = gpt_tp(tp, dp * tp, L, C, 32, T, 8, micro)
            assert (est["params_local"], est["tp_bytes_per_step"]) == (t["params_local"], t["bytes_per_step"])
        assert t["params_total"] == whole + split
        padded = m["padded_params"]
        assert m["memory_bytes"] == theory_bytes(m["stage"], padded, dp, isz, padded // dp), (key(m), m["stage"])
        if m["stage"] < 3:     # ZeRO's own traffic over the data-parallel group, as without TP (data; checks apart)
            assert m["comm_bytes_per_step"] == theory_comm_bytes(m["stage"], padded, dp, isz, micro)


# ---- activations: measured on the C kernels, and checkpointed -------------------------------------------
def test_tp_checkpointed_activations_give_the_same_bits_and_their_formula(tmp_path):
    """--tp 2 on dp 2 x tp 2 with --checkpoint-activations (refused while the TP GPT had no C-kernel path):
    the same losses and final_params_sha256 as without it, the activations the workspace measured equal to
    their formula in tp (and fewer), the TP all-reduce bytes 6 per block (the recomputed forward's again)."""
    common = GPT + ["--dtype", "fp32", "--stage", "2", "--tp", "2", "--micro-batches", "2", "--steps", "4",
                    "--log-every", "1000"]
    plain = run_train(4, tmp_path, *common, tag="plain")
    ckpt = run_train(4, tmp_path, *common, "--checkpoint-activations", tag="ckpt")
    assert ckpt["losses"] == plain["losses"] and ckpt["final_params_sha256"] == plain["final_params_sha256"]
    for m, on in ((plain, False), (ckpt, True)):
        rows, L = 8 // 2 // 2, 2
        want = gpt_activation_bytes(rows, 16, 32, L, 4, 32, on, tp=2)["total"]
        assert m["activation_bytes"] == m["activation_theory_bytes"] == want, (on, m["activation_bytes"], want)
        t = m["tensor_parallel"]
        calls = 2 * L * (6 if on else 4)          # 2 micro-batches x L blocks x all-reduces, each (K-1)/K x 2 sent
        assert t["bytes_per_step"] == t["theory_bytes_per_step"] == calls * 2 * (rows * 16 * 32 // 2) * 4
    assert ckpt["activation_bytes"] < plain["activation_bytes"]


# ---- checkpoints ---------------------------------------------------------------------------------------
def consolidate(ckpt, out):
    return subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "consolidate", str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def test_checkpoints_per_tp_rank_consolidate_and_resume_at_another_dp(tmp_path):
    common = GPT + ["--dtype", "fp32", "--stage", "2", "--log-every", "1000"]
    full = run_train(4, tmp_path, *common, "--tp", "2", "--steps", "6", tag="full")
    run_train(4, tmp_path, *common, "--tp", "2", "--steps", "3", "--save-dir", tmp_path / "tp", tag="a")
    assert sorted(p.name for p in (tmp_path / "tp").iterdir()) == ["tp0-of-2", "tp1-of-2"]
    run_train(2, tmp_path, *common, "--steps", "3", "--save-dir", tmp_path / "dp", tag="b")
    for name in ("tp", "dp"):
        proc = consolidate(tmp_path / name, tmp_path / f"{name}.npz")
        assert proc.returncode == 0, proc.stderr
    a, b = np.load(tmp_path / "tp.npz"), np.load(tmp_path / "dp.npz")
    assert sorted(a.files) == sorted(b.files)
    for n in b.files:
        assert a[n].shape == b[n].shape, n
        # Adam divides by sqrt(v): a gradient that is ~0 in exact arithmetic (the key bias: softmax ignores
        # a shift) moves its parameter by rounding noise / eps, so the absolute tolerance is 2e-5, not 1e-7.
        assert np.allclose(a[n], b[n], rtol=1e-4, atol=2e-5), (n, np.abs(a[n] - b[n]).max())
    # Resume the dp2 x tp2 checkpoint at dp1 x tp2: the rest of the run follows the straight one.
    resumed = run_train(2, tmp_path, *common, "--tp", "2", "--steps", "6", "--resume", tmp_path / "tp", tag="r")
    assert resumed["first_step"] == 3 and len(resumed["losses"]) == 3
    worst = max(abs(x - y) / abs(y) for x, y in zip(resumed["losses"], full["losses"][3:]))
    assert worst <= 1e-5, worst
    # At another TP size: one line, exit 2.
    proc = run_mpi(4, ["-m", "zerompi.train", *common, "--tp", "4", "--steps", "6", "--resume", tmp_path / "tp"],
                   timeout=120, check=False)
    assert proc.returncode == 2 and "tp" in proc.stderr, proc.stderr


def test_a_fresh_run_never_overwrites_tp_checkpoints(tmp_path):
    """The TP ranks' checkpoints live in DIR/tp{r}-of-{K}: a fresh run into DIR (with or without --tp) is
    refused as for any checkpoints there, and --overwrite replaces them in every TP folder."""
    common = GPT + ["--dtype", "fp32", "--log-every", "1000", "--save-dir", tmp_path / "d"]
    run_train(2, tmp_path, *common, "--tp", "2", "--steps", "2", tag="a")
    before = {p.name: (p / "latest").read_text() for p in (tmp_path / "d").iterdir()}
    assert {k: v.splitlines()[0] for k, v in before.items()} == {"tp0-of-2": "step_000002", "tp1-of-2": "step_000002"}
    for extra in (["--tp", "2"], []):
        proc = run_mpi(2, ["-m", "zerompi.train", *common, *extra, "--steps", "1"], timeout=120, check=False)
        line = one_line(proc, 2, "already holds checkpoints", "tp0-of-2/step_000002", "tp1-of-2/step_000002")
        assert "--overwrite" in line
        assert {p.name: (p / "latest").read_text() for p in (tmp_path / "d").iterdir()} == before
    run_train(2, tmp_path, *common, "--tp", "2", "--steps", "3", "--overwrite", tag="b")
    for sub in ("tp0-of-2", "tp1-of-2"):
        assert sorted(p.name for p in (tmp_path / "d" / sub).iterdir()) == ["latest", "step_000003"], sub


# ---- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,extra,needle", [
    (4, ["--model", "gpt", "--n-head", "3", "--d-model", "48", "--tp", "3"], "tp=3 does not divide the 4 ranks"),
    (2, GPT + ["--tp", "0"], "tp=0"),
    (2, ["--model", "gpt", "--n-head", "3", "--d-model", "48", "--tp", "2"], "tp=2 does not divide n_head=3"),
    (2, ["--model", "mlp", "--width", "32", "--tp", "4"], "tp=4 does not divide the 2 ranks"),
    (4, ["--model", "mlp", "--width", "30", "--tp", "4"], "tp=4 does not divide width=30"),
    (2, ["--model", "mlp", "--depth", "3", "--tp", "2"], "depth=3 is odd"),
    (2, ["--model", "mlp", "--tp", "2", "--device", "gpu"], "device='gpu' needs CuPy and a visible GPU"),   # taken
    (4, GPT + ["--tp", "4", "--node-size", "2"], "tp=4 does not divide node_size=2"),
    (4, GPT + ["--tp", "2", "--batch", "5"], "batch=5 does not split over 2 data-parallel ranks"),
])
def test_bad_tp_input_is_one_line_and_exit_2(n, extra, needle):
    proc = run_mpi(n, ["-m", "zerompi.train", *extra, "--steps", "2"], timeout=60, check=False)
    lines = zerompi_lines(proc.stderr)     # zerompi's own lines: a launcher may add its banner
    no_python_noise(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (proc.returncode, proc.stderr)


def test_engine_with_tp_needs_the_split():
    code = ("import zerompi, numpy as np\n"
            "try:\n"
            "    zerompi.ZeroEngine([('l', {'w': np.zeros(4, np.float32)})], zerompi.ZeroConfig(),\n"
            "                       mesh_config=zerompi.MeshConfig(tp=2))\n"
            "except zerompi.UsageError as e:\n"
            "    print('REFUSED', e)\n")
    proc = run_mpi(2, ["-c", code], timeout=60)
    assert proc.stdout.count("REFUSED") == 2 and "tp_split" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["--tp", "3", "--ranks", "4", "--n-layer", "2", "--d-model", "36", "--n-head", "4", "--seq-len", "16",
      "--vocab", "32", "--batch", "8"], "tp=3 does not divide the 4 ranks"),
    (["--tp", "2", "--ranks", "4", "--n-layer", "2", "--d-model", "32", "--batch", "8"], "missing: --n-head"),
    (["--tp", "2", "--ranks", "4", "--params", "1e6"], "tp=2: give the GPT's dimensions"),
    (["--tp", "2", "--ranks", "4", "--n-layer", "2", "--d-model", "33", "--n-head", "3", "--seq-len", "16",
      "--vocab", "32", "--batch", "8"], "tp=2 does not divide d_model=33"),
    (["--tp", "4", "--ranks", "4", "--n-layer", "2", "--d-model", "36", "--n-head", "6", "--seq-len", "16",
      "--vocab", "32", "--batch", "8"], "tp=4 does not divide n_head=6"),
    (["--tp", "0", "--ranks", "4", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16",
      "--vocab", "32", "--batch", "8"], "tp=0 must be a whole number >= 1"),
])
def test_estimator_bad_tp_input_is_one_line_and_exit_2(args, needle):
    proc = subprocess.run([sys.executable, "-m", "zerompi.estimate", *args], capture_output=True, text=True,
                          timeout=60, cwd=str(ROOT))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_estimator_tp_rows():
    out = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--tp", "2", "--ranks", "4", "--n-layer", "2",
                          "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--vocab", "32",
                          "--batch", "8", "--dtype", "fp32"], capture_output=True, text=True,
                         timeout=60, cwd=str(ROOT)).stdout
    # GPT, L=2, C=32, V=32, T=16: split 2(12C^2 + 7C) = 25,024 -> 12,512 per TP rank; whole 1,984.
    assert "Ψ_local = 14,496 of Ψ = 27,008" in out and "65,536 bytes" in out, out


def test_estimator_tp_activations_with_and_without_checkpointing(tmp_path):
    """The estimate with --tp counts a TP rank's activations (the formula zerompi.train measures, in tp) and,
    with --checkpoint-activations (refused before), 6 TP all-reduces per block in place of 4."""
    dims = ["--ranks", "4", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--vocab", "32",
            "--batch", "8", "--dtype", "fp32"]
    got = {}
    for ckpt in (False, True):
        path = tmp_path / f"{ckpt}.json"
        proc = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--tp", "2", *dims, "--json", str(path)]
                              + (["--checkpoint-activations"] if ckpt else []), capture_output=True, text=True,
                              timeout=60, cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr
        got[ckpt] = json.loads(path.read_text())
        act = gpt_activation_bytes(4, 16, 32, 2, 4, 32, ckpt, tp=2)["total"]       # rows: 8 / (4/2) data-parallel
        assert got[ckpt]["activations"]["bytes"] == act and got[ckpt]["stages"][0]["activation_bytes"] == act
        assert "c = C/2" in got[ckpt]["activations"]["formula"]
    # 6 all-reduces per block with checkpointing, 4 without
    assert (got[True]["tensor_parallel"]["tp_bytes_per_step"] * 4
            == got[False]["tensor_parallel"]["tp_bytes_per_step"] * 6)


def test_public_mesh_groups_and_tp_all_reduce():
    code = ("import json, numpy as np, zerompi\n"
            "from mpi4py import MPI\n"
            "w = MPI.COMM_WORLD; r = w.Get_rank()\n"
            "m = zerompi.Mesh(tp=2)\n"
            "x = np.random.default_rng(r).standard_normal(12)\n"
            "want = sum(np.random.default_rng(p).standard_normal(12) for p in m.tp_ranks)\n"
            "got = m.tp_comm.all_reduce(x.copy())\n"
            "every = m.tp_mpi.allgather(got.tobytes())\n"
            "try:\n"
            "    zerompi.Mesh(tp=4, node_size=2); bad = None\n"
            "except zerompi.ConfigError as e:\n"
            "    bad = str(e)\n"
            "rows = w.gather([r, m.ranks, m.tp_rank, m.dp_rank, m.zero_comm.size, m.tp_comm.size,\n"
            "                 float(np.abs(got - want).max()), len(set(every)), m.tp_comm.bytes_sent(), bad])\n"
            "if r == 0:\n"
            "    print('MESH ' + json.dumps(rows), flush=True)\n")
    out = run_mpi(4, ["-c", code], timeout=60).stdout
    rows = next(json.loads(line[5:]) for line in out.splitlines() if line.startswith("MESH "))
    assert len(rows) == 4
    for r, ranks, tp_rank, dp_rank, dp_size, tp_size, err, distinct, sent, bad in rows:
        assert ranks == [[0, 1], [2, 3]] and (tp_rank, dp_rank) == (r % 2, r // 2) and dp_size == tp_size == 2
        assert err < 1e-15 and distinct == 1          # the sum, the same bits on both TP ranks
        assert sent == 2 * (12 // 2) * 8               # reduce-scatter + all-gather: one 6-value slice each
        assert bad == "tp=4 does not divide node_size=2; a tensor-parallel group must sit inside one node"


@pytest.mark.parametrize("n, kind", [(4, "raise"), (4, "hang"), (2, "raise")])
def test_a_failing_rank_ends_the_whole_tp_job(n, kind):
    """ZEROMPI_FAULT's rank is the world rank, also under TP: world rank 1 (TP rank 1 of data-parallel
    group 0) raises or hangs at step 2, and no other rank; every rank ends, the hang by the watchdog
    (the TP all-reduce waits are timed too), well before the test's timeout. The rank was matched
    against the data-parallel rank: at N = 2 it never fired (exit 0), at N = 4 it fired on ranks 2 and 3."""
    import os
    import time
    env = {k: v for k, v in os.environ.items() if k != "ZEROMPI_FAULT"}
    env["ZEROMPI_FAULT"] = f"{kind}@rank1:step2"
    t = time.perf_counter()
    proc = run_mpi(n, ["-m", "zerompi.train", "--model", "mlp", "--width", "32", "--depth", "4", "--batch", "8",
                       "--steps", "4", "--tp", "2", "--timeout-s", "5"], timeout=90, env=env, check=False)
    assert proc.returncode != 0 and time.perf_counter() - t < 60, (proc.returncode, proc.stderr[-2000:])
    lines = zerompi_lines(proc.stderr + proc.stdout)
    if kind == "raise":     # the abort hook names the failing world rank
        failed = [line for line in lines if line.endswith(" failed:")]
        assert failed == ["zerompi: rank 1 failed:"], proc.stderr[-2000:]
        assert "injected fault 'raise' on rank 1 at step 2" in proc.stderr
    else:                   # the fault says it fired, once; a waiting rank's watchdog names the collective
        fired = [line for line in lines if line.startswith("zerompi: injected fault 'hang' on rank 1 at step 2")]
        assert len(fired) == 1, proc.stderr[-2000:]
        assert any("collective timeout" in line and not line.startswith("zerompi: rank 1:") for line in lines), lines
