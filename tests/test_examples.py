"""The examples/ programs at N = 1, 2, 3 (the pipelined one at 2 and 4) and stages 0-3 against single-process float64
NumPy."""
import importlib.util
import math
import re

import numpy as np
import pytest

from tests.mpirun import ROOT, run_mpi


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def adamw64(params, grads, state, t, lr, b1=0.9, b2=0.999, eps=1e-8):
    for k, g in grads.items():
        m, v = state.setdefault(k, (np.zeros_like(g), np.zeros_like(g)))
        m[...] = b1 * m + (1 - b1) * g
        v[...] = b2 * v + (1 - b2) * g * g
        params[k] -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def least_squares_reference(steps):
    ex = load_example("least_squares")
    a, b = ex.make_problem()
    p = {"x": np.zeros(a.shape[1]), "c": np.zeros(1)}
    state = {}
    for t in range(steps):
        r = a @ p["x"] + p["c"] - b
        adamw64(p, {"x": 2 * a.T @ r / len(b), "c": 2 * r.sum(keepdims=True) / len(b)}, state, t + 1,
                ex.lr_at(t, steps))
    exact = np.linalg.lstsq(np.c_[a, np.ones(len(b))], b, rcond=None)[0]
    return p, exact


def custom_model_reference(steps, n):
    ex = load_example("custom_model")
    p = {k: v.astype(np.float64) for lay in ex.build() for k, v in lay.init.items()}
    names = ["in", "mid", "out"]
    state = {}
    for t in range(steps):
        x, y = ex.batch(t)
        per = len(x) // n
        x, y = x[:per * n].astype(np.float64), y[:per * n].astype(np.float64)
        hs = [x]
        for i, nm in enumerate(names):
            z = hs[-1] @ p[f"{nm}.W"] + p[f"{nm}.b"]
            hs.append(np.tanh(z) if i < 2 else z)
        dy = 2 * (hs[-1] - y) / len(x)
        grads = {}
        for i in reversed(range(3)):
            nm = names[i]
            dz = dy * (1 - hs[i + 1] ** 2) if i < 2 else dy
            grads[f"{nm}.W"], grads[f"{nm}.b"] = hs[i].T @ dz, dz.sum(0)
            dy = dz @ p[f"{nm}.W"].T
        adamw64(p, grads, state, t + 1, 1e-2)
    return p


CASES = [(n, s) for n in (1, 2, 3) for s in range(4)]


@pytest.mark.parametrize("n,stage", CASES)
def test_least_squares(tmp_path, n, stage):
    out = tmp_path / "ls.npz"
    proc = run_mpi(n, ["examples/least_squares.py", "--stage", stage, "--steps", 300, "--out", out], timeout=120)
    assert "relative distance to lstsq solution" in proc.stdout
    got = np.load(out)
    ref, exact = least_squares_reference(300)
    sol = np.r_[got["x"], got["c"]]
    np.testing.assert_allclose(sol, np.r_[ref["x"], ref["c"]], rtol=0, atol=1e-4)
    assert np.linalg.norm(sol - exact) / np.linalg.norm(exact) < 1e-4


@pytest.mark.parametrize("n,stage", CASES)
def test_custom_model(tmp_path, n, stage):
    out = tmp_path / "cm.npz"
    steps = 40
    run_mpi(n, ["examples/custom_model.py", "--stage", stage, "--steps", steps, "--out", out], timeout=120)
    got = np.load(out)
    ref = custom_model_reference(steps, n)
    init = {k: v for lay in load_example("custom_model").build() for k, v in lay.init.items()}
    for k, want in ref.items():
        moved = np.linalg.norm(want - init[k])
        assert moved > 0 and np.linalg.norm(got[k] - want) / moved < 1e-4, k


def test_custom_model_fp16_trains(tmp_path):
    proc = run_mpi(3, ["examples/custom_model.py", "--stage", 3, "--dtype", "fp16", "--steps", 150], timeout=120)
    losses = [float(re.search(r"loss\(rank 0\) (\S+)", out_line).group(1)) for out_line in proc.stdout.splitlines()
              if out_line.startswith("step")]
    assert losses[-1] < 0.1 * losses[0] and all(math.isfinite(x) for x in losses)


def pipeline_model_reference(steps):
    """The 4-layer network in float64 on the whole global batch (the pipeline's micro-batches are equal
    parts of it on every data-parallel rank: the mean of their means is the batch's mean)."""
    ex = load_example("pipeline_model")
    layers = ex.build()
    p = {k: v.astype(np.float64) for lay in layers for k, v in lay.init.items()}
    state = {}
    for t in range(steps):
        x, y = (a.astype(np.float64) for a in ex.batch(t))
        hs = [x]
        for i, lay in enumerate(layers):
            z = hs[-1] @ p[f"{lay.name}.W"] + p[f"{lay.name}.b"]
            hs.append(np.tanh(z) if lay.act else z)
        dy = 2 * (hs[-1] - y) / len(x)
        grads = {}
        for i in reversed(range(len(layers))):
            lay = layers[i]
            dz = dy * (1 - hs[i + 1] ** 2) if lay.act else dy
            grads[f"{lay.name}.W"], grads[f"{lay.name}.b"] = hs[i].T @ dz, dz.sum(0)
            dy = dz @ p[f"{lay.name}.W"].T
        adamw64(p, grads, state, t + 1, 1e-2)
    return p


@pytest.mark.parametrize("n,stage,schedule", [(2, 0, "gpipe"), (4, 1, "1f1b"), (4, 2, "gpipe"), (4, 3, "1f1b")])
def test_pipeline_model(tmp_path, n, stage, schedule):
    out = tmp_path / "pm.npz"
    steps = 40
    run_mpi(n, ["examples/pipeline_model.py", "--stage", stage, "--schedule", schedule, "--steps", steps,
                "--out", out], timeout=120)
    got = np.load(out)
    ref = pipeline_model_reference(steps)
    init = {k: v for lay in load_example("pipeline_model").build() for k, v in lay.init.items()}
    assert sorted(got.keys()) == sorted(ref)                  # both stages' layers
    for k, want in ref.items():
        moved = np.linalg.norm(want - init[k])
        assert moved > 0 and np.linalg.norm(got[k] - want) / moved < 1e-4, k
