"""``--replicas`` with parts: pipeline chunks (``--pp``, ``pp{c}-of-{C}``), tensor-parallel ranks (``--tp``,
``tp{r}-of-{K}``) and an MoE run's expert-parallel experts (``--ep``, ``ep{j}-of-{K}`` beside the dense engine's
shard), each engine's shard committed in its part folder on its node and a buddy's.

A rank killed (kill -9) or a whole emulated node lost (2 nodes x 2 ranks) in the middle of a pipelined or
tensor-parallel run: the supervisor relaunches, the job finishes with exit 0, at most one step is lost, and the
final parameters equal bit for bit those of a run that saved a disk checkpoint at the restored step and resumed
(the oracle of tests/test_replicas.py; with --ep the run that never failed: the same N, whose resume is exact,
tests/test_moe_checkpoint.py). The restore assembles every part of the newest step committed in every
part, never pieces of two steps (no MPI). What is not covered is refused in one line.
"""
import json
import os

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.test_replicas import GPT, job_name, oracle, supervise
from zerompi.checkpoint.format import build_manifest, read_manifest
from zerompi.checkpoint.replica_files import assemble, commit, job_dir, rank_dir, step_dir
from zerompi.checkpoint.writer import write_shard

PP = GPT + ["--pp", "2", "--micro-batches", "2", "--node-size", "2"]
MOE = GPT + ["--experts", "4", "--top-k", "2", "--expert-hidden", "24", "--ep", "2", "--stage", "3"]
NODES = {"ZEROMPI_NODE_SIZE": "2"}     # --node-size is refused with --ep: the variable makes the 2 nodes of 2


@pytest.mark.parametrize("stage", [1, 3])
def test_pp_a_killed_rank_costs_at_most_one_step_and_no_bits(tmp_path, stage):
    flags = PP + ["--stage", str(stage)]
    proc, m = supervise(tmp_path, job_name(f"pp-rank{stage}"), 4, flags, kill_at=3, ranks=[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == 1 and f["steps_lost"] <= 1 and f["restored_step"] >= 3, f
    assert m["replicas"]["parts"] == ["pp0-of-2"]
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, f["restored_step"])


@pytest.mark.parametrize("mesh", [PP[-6:], ["--tp", "2", "--node-size", "2"]])
def test_pp_tp_a_lost_node_is_restored_from_its_buddies(tmp_path, mesh):
    """Node 1 (ranks 2, 3: with --pp 2 the whole second stage, with --tp 2 both TP ranks of data-parallel rank 1)
    killed and its shared memory wiped: its shards come from node 0's copies."""
    flags = GPT + mesh + ["--stage", "3"]
    proc, m = supervise(tmp_path, job_name("node" + mesh[0]), 4, flags, kill_at=4, ranks=[2, 3], wipe=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["steps_lost"] <= 1 and f["rank"] == 2, f
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, f["restored_step"])


@pytest.mark.parametrize("mesh, parts", [(["--tp", "2"], {"tp0-of-2", "tp1-of-2"}), (["--sp", "2"], {""}),
                                         (["--tp", "2", "--pp", "2", "--micro-batches", "2"],
                                          {"pp0-of-2/tp0-of-2", "pp0-of-2/tp1-of-2"})])
def test_tp_sp_a_killed_rank_costs_at_most_one_step_and_no_bits(tmp_path, mesh, parts):
    """--tp 2 (2 data-parallel ranks of each TP rank, across the nodes), --sp 2 (no parts: one engine over the
    data- and sequence-parallel ranks), and --tp 2 --pp 2 (one rank per part)."""
    flags = GPT + ["--stage", "3", "--node-size", "2", *mesh]
    proc, m = supervise(tmp_path, job_name("mesh" + "".join(mesh[::2])), 4, flags, kill_at=3, ranks=[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == 1 and f["steps_lost"] <= 1 and f["restored_step"] >= 3, f
    assert m["replicas"]["parts"][0] in parts
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, f["restored_step"])


@pytest.mark.parametrize("tag, ranks, wipe, extra", [("ep-rank", [1], False, []),
                                                     ("ep-node", [2, 3], True, ["--bias-update", "0.01"]),
                                                     ("ep1-rank", [1], False, ["--ep", "1", "--bias-update", "0.01"])])
def test_ep_a_killed_rank_or_lost_node_costs_at_most_one_step_and_no_bits(tmp_path, tag, ranks, wipe, extra):
    """--experts 4 --ep 2 at N = 4 (EP groups {0, 1} and {2, 3}; the experts' engine over ranks {0, 2} and
    {1, 3}): rank 1 killed, or node 1 lost (ranks 2 and 3, its folder wiped: its dense shards and its EP ranks'
    experts come from node 0's copies) with --bias-update (the selection biases in the dense manifest); at --ep 1
    (one engine) with --bias-update, rank 1 killed. The run ends with the bits, the losses after the restore and
    the biases of the run that never failed."""
    flags = MOE + extra
    proc, m = supervise(tmp_path, job_name(tag), 4, flags, kill_at=3, ranks=ranks, wipe=wipe, env=NODES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == ranks[0] and f["steps_lost"] <= 1 and f["restored_step"] >= 3, f
    parts = [""] if "ep1" in tag else ["", "ep0-of-2"]
    assert m["replicas"]["parts"] == parts and m["replicas"]["theory_bytes"]["files"] == 2 * len(parts)
    out = tmp_path / "straight.json"
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", out], timeout=180, env=NODES)
    want = json.loads(out.read_text())
    assert m["final_params_sha256"] == want["final_params_sha256"]
    assert m["losses"] == want["losses"][m["first_step"]:] and m["moe"]["bias"] == want["moe"]["bias"]
    assert bool(extra) == any(v != 0 for b in want["moe"]["bias"].values() for v in b)


@pytest.mark.slow
@pytest.mark.parametrize("tag, n, rank, mesh, parts", [
    ("ppep", 4, 1, ["--pp", "2", "--micro-batches", "2"], ["pp0-of-2", "pp0-of-2/ep0-of-2"]),
    ("tpep", 4, 1, ["--tp", "2"], ["tp0-of-2", "tp0-of-2/ep0-of-2"]),
    ("pptpep", 8, 5, ["--pp", "2", "--tp", "2", "--micro-batches", "2"],
     ["pp0-of-2/tp0-of-2", "pp0-of-2/tp0-of-2/ep0-of-2"])])
def test_ep_with_pp_or_tp_a_killed_rank_costs_at_most_one_step_and_no_bits(tmp_path, tag, n, rank, mesh, parts):
    """--experts 4 --ep 2 --bias-update at stage 3 in 2 nodes: N = 4 with --pp 2 (each stage's 2 ranks one EP
    group: rank 1 holds chunk 0 and EP rank 1's experts of it, parts pp0-of-2 and pp0-of-2/ep1-of-2) or with --tp 2
    (EP groups {0, 2} and {1, 3}: rank 1's parts tp1-of-2 and tp1-of-2/ep0-of-2, the folders of a disk save); N = 8
    with --pp 2 --tp 2 (rank 5: pp1-of-2/tp1-of-2 and its ep0-of-2). One rank killed mid-run: the job ends with
    exit 0, at most one step lost, and the bits, the losses after the restore and the selection biases of the run
    that never failed (whose resume from a disk checkpoint is exact: tests/test_moe_pipeline_ep.py). Without a
    fault, --replicas changes no bit."""
    flags, env = MOE + mesh + ["--bias-update", "0.01"], {"ZEROMPI_NODE_SIZE": str(n // 2)}
    proc, m = supervise(tmp_path, job_name(tag), n, flags, kill_at=3, ranks=[rank], env=env, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == rank and f["steps_lost"] <= 1 and f["restored_step"] >= 3, f
    assert m["replicas"]["parts"] == parts and m["replicas"]["theory_bytes"]["files"] == 2 * len(parts)
    out, quiet = tmp_path / "straight.json", tmp_path / "quiet.json"
    run_mpi(n, ["-m", "zerompi.train", *flags, "--metrics-json", out], timeout=300, env=env)
    run_mpi(n, ["-m", "zerompi.train", *flags, "--metrics-json", quiet, "--replicas", job_name(tag + "q")],
            timeout=300, env=env)
    want, clean = json.loads(out.read_text()), json.loads(quiet.read_text())
    assert m["final_params_sha256"] == want["final_params_sha256"] == clean["final_params_sha256"]
    assert clean["losses"] == want["losses"] and clean["replicas"]["parts"] == parts
    assert m["losses"] == want["losses"][m["first_step"]:] and m["moe"]["bias"] == want["moe"]["bias"]
    assert any(v != 0 for b in want["moe"]["bias"].values() for v in b)
    assert not os.path.exists(job_dir(job_name(tag + "q")))


def test_an_ep_step_is_whole_with_every_ep_part(tmp_path, monkeypatch):
    """No MPI: the dense part ('') and the experts of EP ranks 0 and 1 (``ep{j}-of-2`` within the step's folder)
    are one whole step; the restore keeps them there, where the MoE load finds them (checkpoint/parts.ep_parts).
    With EP rank 1's experts gone from every folder, the step before is taken."""
    from zerompi.checkpoint.parts import ep_parts
    from zerompi.checkpoint.replica_files import whole_set
    monkeypatch.setenv("ZEROMPI_REPLICAS_ROOT", str(tmp_path))
    assert whole_set(["", "ep1-of-2"]) == ["", "ep0-of-2", "ep1-of-2"]
    assert whole_set(["tp0-of-2"]) == ["tp0-of-2", "tp1-of-2"] and whole_set([""]) == [""]
    # with --tp or --pp: beside each dense part of a chunk that holds experts (--moe-every: not every chunk does)
    assert whole_set(["tp1-of-2/ep0-of-2"]) == ["tp0-of-2", "tp1-of-2", "tp0-of-2/ep0-of-2", "tp0-of-2/ep1-of-2",
                                                "tp1-of-2/ep0-of-2", "tp1-of-2/ep1-of-2"]
    assert whole_set(["pp0-of-2", "pp1-of-2/ep1-of-2"]) == ["pp0-of-2", "pp1-of-2", "pp1-of-2/ep0-of-2",
                                                            "pp1-of-2/ep1-of-2"]
    dense = [f"pp{c}-of-2/tp{r}-of-2" for c in range(2) for r in range(2)]
    assert whole_set(["pp1-of-2/tp0-of-2/ep0-of-2"]) == dense + [f"{d}/ep{j}-of-2" for d in dense[2:] for j in range(2)]
    parts = ["", "ep0-of-2", "ep1-of-2"]
    five = _commit_parts(5, parts, parts)
    for r in (0, 1):
        os.rename(step_dir(rank_dir("j", r, r), 5), step_dir(rank_dir("j", r, r), 4) + "x")
    _commit_parts(6, parts, parts)
    for r in (0, 1):
        os.rename(step_dir(rank_dir("j", r, r), 4) + "x", step_dir(rank_dir("j", r, r), 5))
        import shutil
        shutil.rmtree(os.path.join(step_dir(rank_dir("j", r, r), 6), "ep1-of-2"))
    step, folder = assemble("j")
    assert step == 5 and sorted(os.listdir(folder)) == ["ep0-of-2", "ep1-of-2", "manifest.json", "shard_00000.npy"]
    manifest = {"extra": {"moe": {"ep": 2}}}
    assert ep_parts(folder, manifest) == [os.path.join(folder, p) for p in parts[1:]]
    assert ep_parts(str(tmp_path / "ck" / "step_000005"), manifest) == [
        str(tmp_path / "ck" / p / "step_000005") for p in parts[1:]]      # a disk save's: beside it
    for p in parts:
        assert np.array_equal(np.load(os.path.join(folder, p, "shard_00000.npy")), five[p])


def _commit_parts(step, parts, committed):
    """No MPI: two nodes of one rank, a pipeline of 2 chunks (rank c holds chunk c, its buddy the other's copy);
    each rank's step folder holds both parts' shards of ``step``, their manifests only in ``committed``."""
    from zerompi.engine.config import ZeroConfig
    from zerompi.layout import FlatLayout

    class Engine:      # what build_manifest reads
        layout = FlatLayout([("l0", [("w", (6,))])], 1, 64, 1)
        steps_taken, step_count, config, optimizer = step, step, ZeroConfig(stage=3), None   # AdamW's rows
        scaler = type("Scaler", (), {"state_dict": lambda self: {"scale": 1.0, "good_steps": 0}})()

        def recorded_config(self):
            return {}
    numel = Engine.layout.shard_numel
    rows = {p: np.full((3, numel), step + 10 * c, np.float32) for c, p in enumerate(parts)}
    for r in (0, 1):
        here = step_dir(rank_dir("j", r, r), step)
        manifests = {}
        for p in parts:
            os.makedirs(os.path.join(here, p), exist_ok=True)
            entry = write_shard(os.path.join(here, p), 0, numel, iter(rows[p]))
            if p in committed:
                manifests[p] = build_manifest(Engine(), [entry], {"data_step": step})
        commit(rank_dir("j", r, r), step, manifests)
    return rows


def test_assemble_takes_the_newest_step_committed_in_every_part(tmp_path, monkeypatch):
    """Step 5 committed in both chunks' folders, step 6 in chunk 0's only (chunk 1's manifests never written):
    the restore is step 5, both parts of it (never step 6's chunk 0 beside step 5's chunk 1), each part folder
    a checkpoint (manifest, shard) with the bytes written; both parts of step 6 lost: one line names them."""
    monkeypatch.setenv("ZEROMPI_REPLICAS_ROOT", str(tmp_path))
    parts = ["pp0-of-2", "pp1-of-2"]
    five = _commit_parts(5, parts, parts)
    for r in (0, 1):       # step 5 out of the way of step 6's commit, which retires the older steps
        os.rename(step_dir(rank_dir("j", r, r), 5), step_dir(rank_dir("j", r, r), 4) + "x")
    _commit_parts(6, parts, ["pp0-of-2"])
    for r in (0, 1):
        os.rename(step_dir(rank_dir("j", r, r), 4) + "x", step_dir(rank_dir("j", r, r), 5))
    step, folder = assemble("j")
    assert step == 5 and sorted(os.listdir(folder)) == parts
    for p in parts:
        manifest, _ = read_manifest(os.path.join(folder, p))
        assert manifest["step"] == 5 and manifest["extra"] == {"data_step": 5}
        assert np.array_equal(np.load(os.path.join(folder, p, "shard_00000.npy")), five[p])
    import shutil
    shutil.rmtree(os.path.join(job_dir("j"), "restore"))
    for r in (0, 1):
        shutil.rmtree(os.path.join(step_dir(rank_dir("j", r, r), 5), "pp1-of-2"))
        os.unlink(os.path.join(step_dir(rank_dir("j", r, r), 6), "pp0-of-2", "shard_00000.npy"))
    with pytest.raises(Exception, match="no surviving copy of shard 0 of pp0-of-2; any shard of pp1-of-2 of "
                                        "committed step 6"):
        assemble("j")


def test_what_is_not_covered_is_refused_in_one_line():
    """--simulate-world stays refused (one line); --tp, --sp, --pp and --ep (with --bias-update, --pp, --tp) are
    not."""
    from zerompi.errors import ConfigError
    from zerompi.train.config import parse_config
    with pytest.raises(ConfigError, match="needs a real job; drop --simulate-world"):
        parse_config([*GPT, "--simulate-world", "4", "--replicas", "j"])
    for mesh in (["--tp", "2"], ["--sp", "2"], ["--pp", "2", "--micro-batches", "2"], ["--tp", "2", *PP[-6:-2]],
                 MOE[len(GPT):] + ["--bias-update", "0.01"], MOE[len(GPT):] + ["--tp", "2"],
                 MOE[len(GPT):] + ["--bias-update", "0.01", "--pp", "2", "--micro-batches", "2", "--tp", "2"]):
        assert parse_config([*GPT, *mesh, "--replicas", "j"]).replicas == "j"
