"""Checkpoints: exact resume, loading at another world size / stage / bucket size, consolidation,
bad input and crash safety (docs/checkpoint.md).

The oracle for what a checkpoint holds is :func:`reassemble`, written here from the manifest
alone (vectorised index arithmetic, no code shared with zerompi.checkpoint): it turns the
raw shard files into master / exp_avg / exp_avg_sq by parameter name.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import CRASH_BACKSTOP, ROOT, one_line, run_mpi, run_train
from zerompi.checkpoint.pointer import latest_name

pytestmark = pytest.mark.every_mpi       # CI runs these under Open MPI too (.ci/run)

SMALL = ["--model", "mlp", "--width", "24", "--depth", "3", "--batch", "12", "--bucket-mb", "0.002",
         "--log-every", "100"]
ROWS = ("master", "exp_avg", "exp_avg_sq")

# Loads a checkpoint at this world size and stage, then writes (rank 0) every optimizer array
# gathered by name, engine.full_parameters(), and whether the stored parameters equal the master.
WORKER = r'''
import json, sys
import numpy as np
from mpi4py import MPI
from zerompi import ZeroEngine
from zerompi.train.config import parse_config
from zerompi.train.run import build_model

flags, ckpt, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = parse_config(flags)
engine = ZeroEngine(build_model(cfg)[0].init_layers(), cfg.zero)
info = engine.load(ckpt)
lay, comm = engine.layout, MPI.COMM_WORLD

def world(arr):
    if cfg.zero.stage == 0:
        return np.array(arr)
    buf = np.zeros(lay.numel, np.float32)
    for b in lay.buckets:
        buf[b.world_slice(engine.rank)] = arr[b.shard_slice]
        comm.Allgather(MPI.IN_PLACE, buf[b.start:b.stop])
    return buf

state = {row: world(engine.optimizer.read_row(row)) for row in ("master", "exp_avg", "exp_avg_sq")}
stored_ok = True
for i in range(lay.num_layers):
    with engine.unsharded(i) as p:
        for name, v in p.items():
            pr = lay.params[name]
            want = state["master"][pr.start:pr.stop].astype(engine.dtype)
            stored_ok &= bool(np.array_equal(np.asarray(v).reshape(-1), want))
full = engine.full_parameters()
report = comm.gather({"bytes_read": info.bytes_read, "shard_numel": lay.shard_numel, "stored_ok": stored_ok})
if engine.rank == 0:
    arrays = {f"{row}/{n}": state[row][pr.start:pr.stop].reshape(pr.shape)
              for row in state for n, pr in lay.params.items()}
    arrays.update({f"full/{n}": a for n, a in full.items()})
    np.savez(out + ".npz", **arrays)
    json.dump({"ranks": report, "step_count": engine.step_count, "steps_taken": engine.steps_taken,
               "loss_scale": engine.loss_scale}, open(out + ".json", "w"))
'''


# ---- independent oracle and helpers -------------------------------------------------
def reassemble(ckpt):
    """{row: {name: array}} from a checkpoint's raw shard files and its manifest (the oracle)."""
    m = json.loads((ckpt / "manifest.json").read_text())
    shards = np.stack([np.load(ckpt / s["file"]) for s in m["shards"]])   # (N, 3, shard_numel)
    out = {row: {} for row in ROWS}
    for p in m["params"]:
        b = m["buckets"][p["bucket"]]
        e = np.arange(p["bucket_offset"], p["bucket_offset"] + p["numel"])
        owner = e // b["slice_numel"]
        offset = b["shard_start"] + e - owner * b["slice_numel"]
        for k, row in enumerate(ROWS):
            out[row][p["name"]] = shards[owner, k, offset].reshape(p["shape"])
    return out


def checkpoint_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "zerompi.checkpoint", *map(str, args)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=str(ROOT))


def snapshot(directory):
    """{relative path: sha256} of every file under directory."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def flat_sha(params, manifest_dir):
    """sha256 of the parameters concatenated in layout order (what the train metrics report)."""
    m = json.loads((manifest_dir / "manifest.json").read_text())
    flat = np.concatenate([params[p["name"]].reshape(-1) for p in m["params"]]).astype("<f4")
    return hashlib.sha256(flat.tobytes()).hexdigest()


def run_worker(n, tmp_path, flags, ckpt, tag):
    script = tmp_path / "load_worker.py"
    script.write_text(WORKER)
    out = tmp_path / tag
    run_mpi(n, [script, json.dumps(flags), ckpt, out], timeout=120)
    return dict(np.load(f"{out}.npz")), json.loads(open(f"{out}.json").read())


# ---- exact resume -------------------------------------------------------------------
@pytest.mark.parametrize("n,stage,flags", [
    (2, 0, ["--dtype", "fp32"]),
    (3, 1, ["--dtype", "fp16", "--micro-batches", "2", "--loss-scale-window", "2"]),
    (2, 2, ["--dtype", "fp16", "--loss-scale-window", "2", "--clip", "0.5"]),
    (3, 3, ["--dtype", "fp32", "--weight-decay", "0.01"]),
    (3, 2, ["--dtype", "bf16", "--weight-decay", "0.5", "--no-decay", "*.bias"]),
])
def test_exact_resume_is_bit_identical(tmp_path, n, stage, flags):
    common = SMALL + ["--stage", str(stage), *flags, "--steps", "6"]
    straight = run_train(n, tmp_path, *common, "--save-dir", tmp_path / "a", "--save-every", "3", tag="straight")
    resumed = run_train(n, tmp_path, *common, "--resume", tmp_path / "a" / "step_000003", tag="resumed")
    assert resumed["final_params_sha256"] == straight["final_params_sha256"]
    assert resumed["first_step"] == 3 and resumed["losses"] == straight["losses"][3:]
    assert resumed["loss_scale"] == straight["loss_scale"] and resumed["steps_applied"] == straight["steps_applied"]
    # The last checkpoint, consolidated offline, is the run's engine.full_parameters().
    assert latest_name(tmp_path / "a") == "step_000006"
    proc = checkpoint_cli("consolidate", tmp_path / "a", tmp_path / "final.npz")
    assert proc.returncode == 0, proc.stderr
    params = dict(np.load(tmp_path / "final.npz"))
    assert flat_sha(params, tmp_path / "a" / "step_000006") == straight["final_params_sha256"]
    oracle = reassemble(tmp_path / "a" / "step_000006")["master"]
    assert params.keys() == oracle.keys() and all(np.array_equal(params[k], oracle[k]) for k in oracle)


# ---- loading at another world size, stage and bucket size --------------------------------
# Tolerance of continuing at the new N against continuing at the old N, K = 3 steps of
# lr 1e-3: only the reduction order (which ranks sum which rows) differs; measured 3e-8
# (fp32) and 1.4e-6 (fp16). At the same N only the stage and buckets change: no bit may.
# Losing or misplacing the AdamW moments moves parameters by about lr per step.
TOL = {"fp32": 5e-7, "fp16": 1e-5}


@pytest.mark.parametrize("old,new", [
    ((4, 3, "fp32", "0.002"), (2, 1, "fp32", "0.005")),
    ((3, 2, "fp16", "0.002"), (2, 3, "fp16", "0.002")),
    ((2, 0, "fp32", "0.005"), (3, 2, "fp32", "0.002")),
    ((2, 3, "fp16", "0.002"), (2, 1, "fp16", "0.005")),
])
def test_load_at_another_world_size_and_stage(tmp_path, old, new):
    def flags(n_stage_dtype_bucket):
        _, stage, dtype, bucket = n_stage_dtype_bucket
        return SMALL[:-4] + ["--log-every", "100", "--stage", str(stage), "--dtype", dtype, "--bucket-mb", bucket]

    a, b = tmp_path / "a", tmp_path / "b"
    run_train(old[0], tmp_path, *flags(old), "--steps", "6", "--save-dir", a, "--save-every", "3", tag="old")
    oracle = reassemble(a / "step_000003")

    # Right after the load the state equals the saved one exactly, on every rank's new slices.
    got, info = run_worker(new[0], tmp_path, flags(new), a / "step_000003", "loaded")
    for row in ROWS:
        for name, want in oracle[row].items():
            assert np.array_equal(got[f"{row}/{name}"], want), (row, name)
    for name, want in oracle["master"].items():
        assert np.array_equal(got[f"full/{name}"], want), name
    assert info["steps_taken"] == 3 and all(r["stored_ok"] for r in info["ranks"])
    for r in info["ranks"]:   # each rank read its own new slices, not the model
        own = 12 * r["shard_numel"] * (new[0] if new[1] == 0 else 1)
        assert 0 < r["bytes_read"] <= own
    consolidated = checkpoint_cli("consolidate", a / "step_000003", tmp_path / "k3.npz")
    assert consolidated.returncode == 0, consolidated.stderr
    k3 = np.load(tmp_path / "k3.npz")
    assert all(np.array_equal(k3[name], want) for name, want in oracle["master"].items())

    # Continued training at the new N matches continuing at the old N within the reduction-order tolerance.
    run_train(new[0], tmp_path, *flags(new), "--steps", "6", "--resume", a / "step_000003", "--save-dir", b,
              tag="new")
    ref, cont = reassemble(a / "step_000006")["master"], reassemble(b / "step_000006")["master"]
    worst = max(float(np.max(np.abs(cont[k] - ref[k]))) for k in ref)
    moved = max(float(np.max(np.abs(ref[k] - oracle["master"][k]))) for k in ref)
    assert worst <= (TOL[new[2]] if new[0] != old[0] else 0.0), worst
    assert moved > 100 * TOL[new[2]]   # the steps after the load did move the parameters


# ---- bad input ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A complete 2-rank stage 3 checkpoint at step 2 (its save dir)."""
    tmp = tmp_path_factory.mktemp("good")
    run_train(2, tmp, *SMALL, "--stage", "3", "--steps", "2", "--save-dir", tmp / "ck")
    return tmp / "ck"


def damaged(good, tmp_path, damage):
    """A copy of the good checkpoint with damage(step_dir) applied; returns the copy's save dir."""
    copy = tmp_path / "ck"
    shutil.copytree(good, copy)
    damage(copy / "step_000002")
    return copy


def flip_byte(path, at=-5):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,expect", [
    (lambda d: (d / "shard_00001.npy").unlink(), ["shard_00001.npy", "missing"]),
    (lambda d: flip_byte(d / "shard_00001.npy"), ["shard_00001.npy", "checksum"]),
])
def test_bad_shard_stops_every_rank_with_exit_2(good, tmp_path, damage, expect):
    # Three ranks load a two-shard checkpoint: rank 1 alone checksums shard 1, rank 2 none;
    # all three must still stop together, and the run must not save over the checkpoint.
    ck = damaged(good, tmp_path, damage)
    before = snapshot(ck)
    proc = run_mpi(3, ["-m", "zerompi.train", *SMALL, "--stage", "1", "--steps", "4", "--resume", ck,
                       "--save-dir", ck], timeout=60, check=False)
    one_line(proc, 2, *expect)
    assert snapshot(ck) == before


def test_manifest_of_another_model_or_nothing_left_to_run(good, tmp_path):
    before = snapshot(good)
    proc = run_mpi(2, ["-m", "zerompi.train", *SMALL, "--width", "32", "--steps", "4", "--resume", good],
                   timeout=60, check=False)
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and "another model" in proc.stderr, proc.stderr
    proc = run_mpi(2, ["-m", "zerompi.train", *SMALL, "--steps", "2", "--resume", good], timeout=60, check=False)
    assert proc.returncode == 2 and "nothing to run" in proc.stderr, proc.stderr
    assert snapshot(good) == before


def test_offline_tools_reject_truncation_and_other_format_versions(good, tmp_path):
    ck = damaged(good, tmp_path, lambda d: os.truncate(d / "shard_00000.npy", 1000))
    proc = checkpoint_cli("consolidate", ck, tmp_path / "out.npz")
    assert proc.returncode == 2 and "shard_00000.npy" in proc.stderr and "truncated" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.npz").exists()

    manifest = ck / "step_000002" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, format_version=99)))
    proc = checkpoint_cli("inspect", ck)
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and "format version 99" in proc.stderr
    manifest.write_text("{not json")
    proc = checkpoint_cli("consolidate", ck, tmp_path / "out.npz")
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert checkpoint_cli("consolidate", tmp_path / "nowhere", tmp_path / "out.npz").returncode == 2


def test_inspect_prints_the_manifest_as_a_table(good):
    proc = checkpoint_cli("inspect", good)
    assert proc.returncode == 0, proc.stderr
    for word in ("step 2", "world size 2", "stage 3", "block2.weight", "24x24", "shard_00001.npy", "loss scale"):
        assert word in proc.stdout, (word, proc.stdout)


def test_save_flags_are_validated():
    from zerompi.errors import ConfigError
    from zerompi.train.config import parse_config
    with pytest.raises(ConfigError, match="save_every=3 needs save_dir"):
        parse_config(["--save-every", "3"])
    with pytest.raises(ConfigError, match="save_every=-1"):
        parse_config(["--save-every", "-1", "--save-dir", "x"])


# ---- atomicity ------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["after_shards", "before_rename", "before_latest"])
def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, point):
    ck = tmp_path / "ck"
    common = ["-m", "zerompi.train", *SMALL, "--stage", "2", "--steps", "4", "--save-dir", ck]
    proc = run_mpi(2, [*common, "--save-every", "2"], timeout=60, check=False,
                   env={"ZEROMPI_CHECKPOINT_CRASH": f"{point}@4", **CRASH_BACKSTOP})
    assert proc.returncode != 0 and "simulated crash" in proc.stderr, proc.stderr
    assert latest_name(ck) == "step_000002"
    before = reassemble(ck / "step_000002")["master"]
    assert checkpoint_cli("consolidate", ck, tmp_path / "p.npz").returncode == 0
    got = np.load(tmp_path / "p.npz")
    assert all(np.array_equal(got[k], v) for k, v in before.items())
    if point == "before_latest":   # the next run resumes from step 2, told of the later step 4, which it keeps
        proc = run_mpi(2, [*common, "--resume", ck], timeout=60)
        assert "holds complete checkpoints of later steps than step_000002, which" in proc.stdout, proc.stdout
        assert latest_name(ck) == "step_000004-1"
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000002", "step_000004", "step_000004-1"]
