"""Checkpoints of an MoE run (train/moe/checkpoints.py): saved at N=4 --ep 2 stage 3, resumed at --ep 2 stage 3
and --ep 4 stage 1 (fp32; fp16 at --ep 4 stage 2): the bits of the run that never stopped; at N=2 --ep 1 stage 2:
its losses to 1e-5, as a plain GPT's resume at another world size. The consolidated checkpoint has an --ep 1
run's names, order, shapes and values; ``inspect`` reads it; --bias-update's selection biases are saved and
restored (the same bits)."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.test_moe_ep import FLAGS, run_many

ROOT = Path(__file__).resolve().parent.parent
F = FLAGS[:-4] + ["--eval-every", "3", "--dtype", "fp32", "--steps"]     # FLAGS without its --steps
BIAS = ["--bias-update", "0.003"]
FP16 = ["--dtype", "fp16"]


def tool(*args):
    return subprocess.run([sys.executable, "-m", "zerompi.checkpoint", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ckpt")
    at = lambda ep, stage: ["--ep", str(ep), "--stage", str(stage)]        # noqa: E731
    n4 = run_many(4, [
        F + ["4"] + at(2, 3) + ["--save-dir", str(d / "full")],                 # 0: never stopped
        F + ["2"] + at(2, 3) + ["--save-dir", str(d / "a"), "--save-every", "1"],   # 1: saved after steps 1, 2
        F + ["4"] + at(2, 3) + ["--resume", str(d / "a")],                      # 2
        F + ["4"] + at(4, 1) + ["--resume", str(d / "a"), "--save-dir", str(d / "a")],   # 3: saved at --ep 4
        F + ["2"] + at(1, 3) + ["--save-dir", str(d / "e1")],                   # 4: the --ep 1 run's checkpoint
        F + ["4"] + at(2, 3) + BIAS,                                            # 5: never stopped, biased
        F + ["2"] + at(2, 3) + BIAS + ["--save-dir", str(d / "b")],             # 6
        F + ["4"] + at(4, 1) + BIAS + ["--resume", str(d / "b")],               # 7
        F + ["4"] + at(1, 2) + BIAS + ["--resume", str(d / "b")],               # 8: an --ep 2 save at --ep 1
        F + ["2"] + at(1, 2) + BIAS + ["--save-dir", str(d / "b1")],            # 9: an --ep 1 save ...
        F + ["4"] + at(2, 0) + BIAS + ["--resume", str(d / "b1")],              # 10: ... at --ep 2
        F + ["4"] + at(2, 3) + FP16,                                            # 11: fp16, never stopped
        F + ["2"] + at(2, 3) + FP16 + ["--save-dir", str(d / "h")],             # 12
        F + ["4"] + at(4, 2) + FP16 + ["--resume", str(d / "h")],               # 13: the loss scale carried
        F + ["4"] + at(2, 3) + ["--save-dir", str(d / "as"), "--save-every", "1", "--async-save"],   # 14
        F + ["4"] + at(4, 1) + ["--resume", str(d / "as" / "step_000002")],      # 15
    ], timeout=600)
    n2 = run_many(2, [F + ["4"] + at(1, 2) + ["--resume", str(d / "a" / "step_000002")]], timeout=300)
    return d, n4, n2


def same_bits(resumed, full):
    assert resumed["first_step"] == 2 and resumed["losses"] == full["losses"][2:]
    assert resumed["final_params_sha256"] == full["final_params_sha256"]


def test_resume_at_another_ep_and_stage_gives_the_same_bits(runs):
    d, n4, _ = runs
    assert sorted(p.name for p in (d / "a").iterdir() if p.name.startswith("ep")) == \
        ["ep0-of-2", "ep0-of-4", "ep1-of-2", "ep1-of-4", "ep2-of-4", "ep3-of-4"]
    for resumed, full in ((n4[2], n4[0]), (n4[3], n4[0]), (n4[13], n4[11]), (n4[15], n4[0])):
        same_bits(resumed, full)
    assert n4[14]["final_params_sha256"] == n4[0]["final_params_sha256"]      # saved in the background
    assert all((d / "as" / f"ep{j}-of-2" / f"step_00000{s}").is_dir() for j in range(2) for s in range(1, 5))
    assert n4[11]["final_params_sha256"] != n4[0]["final_params_sha256"]


def test_resume_at_another_world_size(runs):
    _, n4, n2 = runs
    resumed, full = n2[0], n4[0]
    assert resumed["first_step"] == 2 and len(resumed["losses"]) == 2
    worst = max(abs(x - y) / abs(y) for x, y in zip(resumed["losses"], full["losses"][2:]))
    assert worst <= 1e-5, worst


def test_consolidated_equals_the_ep1_runs(runs):
    d, n4, _ = runs
    # step 2 of the --ep 2 save against the --ep 1 run's; step 4, saved at --ep 4 into the same folder (the
    # --ep 2 parts still there), against the run that never stopped
    for name, path in (("a2", d / "a" / "step_000002"), ("e1", d / "e1"), ("a4", d / "a"), ("full", d / "full")):
        proc = tool("consolidate", path, d / f"{name}.npz")
        assert proc.returncode == 0, proc.stderr
    for x, y in (("a2", "e1"), ("a4", "full")):
        a, b = np.load(d / f"{x}.npz"), np.load(d / f"{y}.npz")
        assert a.files == b.files and "block0.experts.fc.w" in a.files       # the same names in the same order
        for n in b.files:                 # --ep 1, 2 and 4 train to the same bits (docs/moe.md)
            assert a[n].shape == b[n].shape and np.array_equal(a[n], b[n]), (x, n)
    a4 = np.load(d / "a4.npz")
    assert a4["block1.experts.out.w"].shape == (4, 24, 16)
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a4[n], "<f4").tobytes() for n in a4.files)).hexdigest()
    assert digest == n4[0]["final_params_sha256"]
    proc = tool("inspect", d / "a")
    assert proc.returncode == 0 and '"ep": 4' in proc.stdout, proc.stdout + proc.stderr
    assert "expert-parallel part ep3-of-4/step_000004: step 4, 8 parameters, 1 shards: verified" in proc.stdout


def test_selection_biases_are_saved_and_restored(runs):
    d, n4, _ = runs
    saved = json.loads((d / "b" / "step_000002" / "manifest.json").read_text())["extra"]["moe"]["bias"]
    assert saved == n4[6]["moe"]["bias"] and any(v != 0 for b in saved.values() for v in b)
    for resumed in (n4[7], n4[8], n4[10]):
        same_bits(resumed, n4[5])
        assert resumed["moe"]["bias"] == n4[5]["moe"]["bias"]
    assert n4[5]["final_params_sha256"] != n4[0]["final_params_sha256"]


def test_a_missing_part_is_refused(runs, tmp_path):
    """A dense checkpoint whose EP part of the same step is missing (a save one part published and another did
    not) is refused on every rank, nothing loaded; a part of another step too."""
    d, _, _ = runs
    import shutil
    shutil.copytree(d / "a", tmp_path / "a")
    shutil.rmtree(tmp_path / "a" / "ep1-of-2" / "step_000002")
    resume = ["-m", "zerompi.train", *F, "4", "--ep", "2", "--resume", tmp_path / "a" / "step_000002"]
    proc = run_mpi(2, resume, timeout=120, check=False)
    assert proc.returncode != 0 and "ep1-of-2/step_000002: does not exist" in proc.stderr, proc.stderr
    assert len(set(proc.stderr.strip().splitlines())) == 1, proc.stderr          # one line (on every rank)
    shutil.copytree(tmp_path / "a" / "ep1-of-2" / "step_000001", tmp_path / "a" / "ep1-of-2" / "step_000002")
    proc = run_mpi(2, resume, timeout=120, check=False)
    assert proc.returncode != 0 and "its parts are of different steps" in proc.stderr, proc.stderr


def test_banner_counts_every_part(tmp_path):
    """The banner's size of one checkpoint is its shard files' bytes, the EP parts' included."""
    from zerompi.train.console import human_bytes
    proc = run_mpi(2, ["-m", "zerompi.train", *F, "1", "--ep", "2", "--save-dir", tmp_path / "s"], timeout=120)
    files = list((tmp_path / "s").glob("**/step_000001/shard_*.npy"))
    assert len(files) == 4                                   # the dense engine's 2, one per EP rank's experts
    assert f"checkpoints: {human_bytes(sum(f.stat().st_size for f in files))} each" in proc.stdout, proc.stdout


def test_resumed_into_its_own_folder_keeps_the_later_steps_in_every_part(runs, tmp_path):
    """Resumed from step 2 of a folder holding steps 1-4 and saving there with --keep-last 1: the later steps are
    the future of the run resumed, kept in the dense folder and in every part alike, and the new step 3 is saved
    under one name in all of them (a resume of the folder reads a whole checkpoint)."""
    import shutil
    d, _, _ = runs
    shutil.copytree(d / "as", tmp_path / "as")
    run_mpi(2, ["-m", "zerompi.train", *F, "3", "--ep", "2", "--resume", tmp_path / "as" / "step_000002",
                "--save-dir", tmp_path / "as", "--keep-last", "1"], timeout=120)
    names = lambda p: sorted(n.name for n in p.iterdir() if n.name.startswith("step_"))   # noqa: E731
    dense = names(tmp_path / "as")
    assert {"step_000003", "step_000004"} < set(dense), dense
    for j in range(2):
        assert names(tmp_path / "as" / f"ep{j}-of-2") == dense, j
    latest = (tmp_path / "as" / "latest").read_text().split()[0]
    assert all((tmp_path / "as" / f"ep{j}-of-2" / latest).is_dir() for j in range(2)), latest
