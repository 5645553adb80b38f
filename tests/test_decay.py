"""Weight-decay groups (ZeroConfig.no_decay, engine/decay.py): the row runs against a brute-force
mask, stages bit-identical with groups, a resharded resume against the float64 reference, and
the errors. The float64 reference for every optimizer path is in tests/test_oracle.py."""
import fnmatch
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, run_mpi, run_train
from tests.reference import train_reference
from zerompi.engine.decay import exempt_runs, pieces
from zerompi.errors import ConfigError
from zerompi.layout import FlatLayout

W, D, B, LR, WD = 32, 3, 24, 1e-2, 0.5
MLP = ["--model", "mlp", "--width", str(W), "--depth", str(D), "--batch", str(B), "--lr", str(LR),
       "--weight-decay", str(WD), "--bucket-mb", "0.004", "--dtype", "fp32", "--log-every", "100"]


def test_pieces_cover_the_slice_in_order():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        mask = rng.random(n) < 0.4                     # True: exempt
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        runs = list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
        a = int(rng.integers(0, n))
        z = int(rng.integers(a + 1, n + 1))
        got = list(pieces(runs, a, z))
        assert got[0][0] == 0 and got[-1][1] == z - a
        assert all(p[1] == q[0] for p, q in zip(got, got[1:]))      # contiguous, in order
        assert all(lo < hi for lo, hi, _ in got)
        decays = np.zeros(z - a, bool)
        for lo, hi, d in got:
            decays[lo:hi] = d
        assert np.array_equal(decays, ~mask[a:z])


@pytest.mark.parametrize("n,stage", [(1, 0), (3, 0), (3, 1), (4, 3), (5, 2)])
def test_exempt_runs_are_the_exempt_parameters_rows(n, stage):
    """Over every rank's slot, the exempt rows map back to exactly the exempt parameters' elements."""
    spec = [(f"l{i}", [(f"l{i}.w", (7, 5)), (f"l{i}.b", (5,)), (f"l{i}.g", (3,))]) for i in range(4)]
    lay = FlatLayout(spec, n, 40, 1)
    patterns = ["*.b", "l2.*"]
    want = np.zeros(lay.numel, bool)
    for name, pr in lay.params.items():
        want[pr.start:pr.stop] = any(fnmatch.fnmatchcase(name, p) for p in patterns)
    got = np.zeros(lay.numel, bool)
    for slot in range(1 if stage == 0 else n):
        for a, z in exempt_runs(lay, patterns, stage, slot):
            if stage == 0:
                got[a:z] = True
                continue
            for b in lay.buckets:                   # shard rows -> this bucket's elements
                lo, hi = b.slice_bounds(slot)
                s0, s1 = max(a, b.shard_start), min(z, b.shard_start + b.slice_numel)
                if s0 < s1:
                    got[b.start + lo + s0 - b.shard_start:b.start + lo + s1 - b.shard_start] = True
    assert np.array_equal(got, want)


def test_a_pattern_matching_nothing_is_an_error():
    lay = FlatLayout([("l0", [("l0.w", (4,))])], 1, 40, 1)
    with pytest.raises(ConfigError, match=r"no_decay pattern 'l0\.bias' .*matches no parameter.*l0\.w"):
        exempt_runs(lay, ["l0.bias"], 0, 0)


def test_stages_bit_identical_with_groups(tmp_path):
    configs = [MLP + ["--steps", "4", "--stage", str(s), "--no-decay", "*.bias"] for s in range(4)]
    configs.append(MLP + ["--steps", "4", "--stage", "2", "--no-decay", "*.bias", "--offload-optimizer", "cpu"])
    configs.append(MLP + ["--steps", "4", "--stage", "3", "--no-decay", "*.bias", "--offload-optimizer", "nvme",
                          "--offload-dir", str(tmp_path)])
    configs.append(MLP + ["--steps", "4", "--stage", "2"])                     # every parameter decays
    proc = run_mpi(3, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=240)
    shas = [json.loads(line[8:])["final_params_sha256"] for line in proc.stdout.splitlines()
            if line.startswith("METRICS ")]
    assert len(shas) == 7
    assert len(set(shas[:6])) == 1, shas
    assert shas[6] != shas[0]


def test_groups_survive_a_resharded_resume(tmp_path):
    """Saved at N=2 stage 1, resumed at N=3 stage 3: the groups come from names, so the whole run
    equals the float64 reference with the same exemptions (and not the one without)."""
    flags = MLP + ["--no-decay", "*.bias"]
    run_train(2, tmp_path, *flags, "--stage", "1", "--steps", "3", "--save-dir", tmp_path / "a", tag="a")
    run_train(3, tmp_path, *flags, "--stage", "3", "--steps", "6", "--resume", tmp_path / "a" / "step_000003",
              "--save-dir", tmp_path / "b", tag="b")
    out = tmp_path / "final.npz"
    proc = subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "consolidate", str(tmp_path / "b"), str(out)],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    got = dict(np.load(out))
    biases = {f"block{i}.bias" for i in range(D)}
    _, want = train_reference(W, D, 0, 6, B, LR, wd=WD, no_decay=biases)
    _, other = train_reference(W, D, 0, 6, B, LR, wd=WD)
    for name in want:
        err = np.max(np.abs(got[name] - want[name]))
        assert err < 1e-5, (name, err)
    assert max(np.max(np.abs(got[k] - other[k])) for k in biases) > 1e-4   # measured 7e-4


def test_cli_flags(tmp_path):
    proc = run_mpi(1, ["-m", "zerompi.train", *MLP, "--steps", "1", "--decay-all", "--no-decay", "*.bias"],
                   timeout=60, check=False)
    assert proc.returncode == 2
    assert "--decay-all and --no-decay" in proc.stderr
    proc = run_mpi(2, ["-m", "zerompi.train", *MLP, "--steps", "1", "--no-decay", "blk*"], timeout=60, check=False)
    assert proc.returncode == 2 and "no_decay pattern 'blk*' (--no-decay) matches no parameter" in proc.stderr
    m = run_train(1, tmp_path, "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch", "2",
                  "--steps", "1")
    assert m["config"]["zero"]["no_decay"] == ["wte", "wpe", "*.b", "*.g"]
