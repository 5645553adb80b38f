"""Expert parallelism inside the pipeline's stages (--pp 2 --ep 2): N=4 gives the bits of the unpipelined N=2 --ep 2
run of the same global batch (final parameters, losses, held-out losses, routing; gradient norms to rounding),
fp32 and fp16, with 1F1B, ZB-H1 and interleaved schedules; a stage whose chunks hold no MoE block; two EP
groups per stage (N=8 against N=4); with --tp 2; with --sp 2 (the EP groups over a stage's DP x SP ranks);
recomputed, with a capacity, biases, stage 3 gathering per step; the expert gradients accumulated per step against
--ep 1's; forced routing ends; exactly balanced routing sends the formula's all-to-all bytes; an --ep that
does not divide a stage's ranks is refused in one line, what no longer is refused is taken."""
import json

import numpy as np
import pytest

from tests.mpirun import run_mpi
from zerompi.errors import ConfigError
from zerompi.train.config import parse_config

FLAGS = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
         "--batch", "12", "--lr", "3e-3", "--bucket-mb", "0.004", "--log-every", "100", "--micro-batches", "2",
         "--experts", "4", "--top-k", "2", "--expert-hidden", "24", "--steps", "3", "--eval-every", "3"]
EP = ["--ep", "2"]


def run_many(n, configs, timeout=400):
    proc = run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=timeout)
    return [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]


def same_bits(flat, piped):
    """The pipelined run ``piped`` against the unpipelined ``flat``: the same bits and routing."""
    assert piped["pipeline"] is not None and flat["pipeline"] is None
    assert piped["moe"]["ep"] == flat["moe"]["ep"] == 2
    for key in ("final_params_sha256", "losses", "val_losses", "params"):
        assert flat[key] == piped[key], (key, flat["stage"], flat["dtype"], piped["pipeline"]["schedule"])
    for key in ("tokens_min", "tokens_mean", "tokens_max", "dropped"):
        assert flat["moe"][key] == piped["moe"][key], key
    assert flat["moe"]["aux_loss"] == pytest.approx(piped["moe"]["aux_loss"], rel=1e-12)
    # the norm's sum of squares runs in another order (stages, then EP ranks): rounding, never an expert twice
    assert flat["moe"]["grad_norms"] == pytest.approx(piped["moe"]["grad_norms"], rel=1e-12)


def stage_configs(stages, dtypes=("fp32", "fp16")):
    return [FLAGS + EP + ["--stage", str(s), "--dtype", d] for s in stages for d in dtypes]


def check_stages(stages):
    configs = stage_configs(stages)
    flat = run_many(2, configs)
    piped = run_many(4, [c + ["--pp", "2"] for c in configs])
    assert len(flat) == len(piped) == len(configs)
    for a, b in zip(flat, piped):
        same_bits(a, b)
        m = b["moe"]        # each rank exchanges for its stage's blocks: the mean over all ranks is half N=2's
        assert m["all_to_all_theory_bytes"] * 2 == a["moe"]["all_to_all_theory_bytes"]
        assert sum(m["all_to_all_bytes"]) * 2 == sum(a["moe"]["all_to_all_bytes"])
        dense = m["memory_bytes_by_engine"]["dense"]
        assert dense["measured"] == dense["theory"]
        assert b["comm_bytes_per_step"] == b["comm_theory_bytes_per_step"]
    assert flat[0]["losses"][-1] < flat[0]["losses"][0]


def test_1f1b_stages_0_and_3_equal_unpipelined():
    check_stages((0, 3))


@pytest.mark.slow
def test_1f1b_stages_1_and_2_equal_unpipelined():
    check_stages((1, 2))


def split_and_interleaved(dtype, stage, schedules):
    """4 blocks, MoE in blocks 1 and 3 (--moe-every 2): interleaved with 2 chunks per stage puts blocks 0 and 2
    (no MoE, no expert engine) on stage 0."""
    flags = list(FLAGS)
    flags[flags.index("--n-layer") + 1] = "4"
    flags += EP + ["--moe-every", "2", "--stage", str(stage), "--dtype", dtype]
    flat = run_many(2, [flags])
    piped = run_many(4, [flags + ["--pp", "2"] + s for s in schedules])
    assert len(flat) == 1 and len(piped) == len(schedules)
    assert flat[0]["moe"]["moe_blocks"] == [1, 3]
    for b in piped:
        same_bits(flat[0], b)
    return piped


def test_zb_h1_and_interleaved_equal_unpipelined():
    piped = split_and_interleaved("fp16", 2, [["--schedule", "zb-h1"], ["--schedule", "interleaved", "--chunks", "2"]])
    assert piped[1]["pipeline"]["stage_of_chunk"] == [0, 1, 0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,stage", [("fp32", 0), ("fp32", 3), ("fp16", 1)])
def test_zb_h1_and_interleaved_more_stages(dtype, stage):
    split_and_interleaved(dtype, stage, [["--schedule", "zb-h1"], ["--schedule", "interleaved", "--chunks", "2"]])


@pytest.mark.slow
def test_interleaved_every_block_moe():
    """Every block MoE, 4 chunks over 2 stages: two expert engines on each rank."""
    flags = list(FLAGS)
    flags[flags.index("--n-layer") + 1] = "4"
    flags += EP + ["--stage", "3", "--dtype", "fp32"]
    flat = run_many(2, [flags])
    piped = run_many(4, [flags + ["--pp", "2", "--schedule", "interleaved", "--chunks", "2"]])
    same_bits(flat[0], piped[0])


@pytest.mark.slow
def test_two_ep_groups_per_stage():
    """N=8 --pp 2 --ep 2: each stage's 4 ranks are 2 EP groups, each expert sharded over 2 expert-data-parallel
    ranks; the bits of N=4 --ep 2."""
    configs = [FLAGS + EP + ["--stage", s, "--dtype", "fp16", "--batch", "16"] for s in ("1", "3")]
    flat = run_many(4, configs)
    piped = run_many(8, [c + ["--pp", "2"] for c in configs], timeout=600)
    assert len(flat) == len(piped) == 2
    for a, b in zip(flat, piped):
        same_bits(a, b)
        assert b["moe"]["memory_bytes_by_engine"]["experts"]["ranks"] == 2


@pytest.mark.slow
def test_gradients_reduced_per_step_equal_ep1():
    """--pp-grad-reduce step: each source's expert partials summed over the micro-batches, then reduced in world
    rank order: the bits of --ep 1's per-step accumulation (not of per-micro-batch reduction: docs/pipeline.md)."""
    configs = [FLAGS + ["--pp", "2", "--pp-grad-reduce", "step", "--stage", "2", "--ep", ep] for ep in ("1", "2")]
    a, b = run_many(4, configs)
    for key in ("final_params_sha256", "losses", "val_losses", "params"):
        assert a[key] == b[key], key


def test_an_ep_that_does_not_divide_a_stage_is_refused_in_one_line():
    """N=6 --pp 2: each stage's 3 data-parallel ranks cannot form EP groups of 2 (they would cross the stages)."""
    cfg = parse_config(FLAGS + EP + ["--pp", "2"], environ={})
    with pytest.raises(ConfigError) as e:
        cfg.check_world(6)
    assert str(e.value).startswith("ep=2 does not divide the 3 data-parallel ranks of each pipeline stage"), e.value
    assert "\n" not in str(e.value)
    cfg.check_world(12)                 # 6 ranks a stage: three EP groups in each


@pytest.mark.parametrize("flag", [["--simulate-world", "4"], ["--node-size", "2"], ["--shard-size", "2"],
                                  ["--hpz", "--stage", "3"], ["--offload-optimizer", "cpu"],
                                  ["--offload-params", "nvme", "--stage", "3", "--offload-dir", "x"]])
def test_what_was_refused_with_pp_ep_is_accepted(flag):
    """Nothing of these is refused any more with --pp --ep (the runs: test_moe_pp_nodes.py, test_moe_simulated.py)."""
    cfg = parse_config(FLAGS + EP + ["--pp", "2"] + flag, environ={})
    assert cfg.mesh.pp == 2 and cfg.moe.ep == 2


def test_checkpoints_with_tp_and_replicas_are_accepted():
    """--save-dir/--resume with --tp, and --replicas (with --bias-update, with --tp), are built with --pp --ep."""
    for extra in (["--tp", "2", "--save-dir", "x"], ["--tp", "2", "--resume", "x"], ["--replicas", "j"],
                  ["--replicas", "j", "--bias-update", "0.01", "--tp", "2"]):
        cfg = parse_config(FLAGS + EP + ["--pp", "2"] + extra, environ={})
        assert cfg.mesh.pp == 2 and cfg.moe.ep == 2


def consolidated(path, out):
    """``python -m zerompi.checkpoint consolidate path out``: the parameters by name, in the file's order."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "consolidate", str(path), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with np.load(out) as z:
        return {n: z[n] for n in z.files}


def test_checkpoints_resume_at_the_same_and_another_ep():
    """N=4 --pp 2 --ep 2 saved after steps 1 and 2 (each chunk's expert part in pp{c}-of-2/ep{j}-of-2), resumed
    to step 4: the bits of the run that never stopped, at --ep 2 stages 3 and 0 and at --ep 1; --bias-update's
    biases restored (the same bits and biases); an --ep 1 pipelined save resumed at --ep 2; in the background.
    Consolidated, the --ep 2 save has the names, order, shapes and values of the --ep 1 one."""
    import tempfile
    from pathlib import Path
    F = FLAGS[:FLAGS.index("--steps")] + ["--eval-every", "4", "--steps"]
    at = lambda ep, stage: ["--pp", "2", "--ep", str(ep), "--stage", str(stage)]      # noqa: E731
    BIAS = ["--bias-update", "0.01"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        runs = run_many(4, [
            F + ["4"] + at(2, 3),                                                        # 0: never stopped
            F + ["2"] + at(2, 3) + ["--save-dir", str(d / "a"), "--save-every", "1"],   # 1
            F + ["4"] + at(2, 3) + ["--resume", str(d / "a")],                          # 2
            F + ["4"] + at(2, 0) + ["--resume", str(d / "a")],                          # 3: another stage
            F + ["4"] + at(1, 3) + ["--resume", str(d / "a")],                          # 4: another --ep
            F + ["4"] + at(2, 3) + BIAS,                                                 # 5: biased, never stopped
            F + ["2"] + at(2, 3) + BIAS + ["--save-dir", str(d / "b")],                 # 6
            F + ["4"] + at(2, 3) + BIAS + ["--resume", str(d / "b")],                   # 7
            F + ["2"] + at(1, 3) + ["--save-dir", str(d / "e1")],                       # 8: an --ep 1 save ...
            F + ["4"] + at(2, 3) + ["--resume", str(d / "e1")],                         # 9: ... at --ep 2
            F + ["2"] + at(2, 0) + ["--save-dir", str(d / "as"), "--save-every", "1", "--async-save"],  # 10
            F + ["4"] + at(2, 3) + ["--resume", str(d / "as")],                         # 11
        ], timeout=900)
        assert len(runs) == 12
        for c in range(2):
            for j in range(2):
                assert sorted(p.name for p in (d / "a" / f"pp{c}-of-2" / f"ep{j}-of-2").iterdir()
                              if p.name.startswith("step_")) == ["step_000001", "step_000002"]
            assert not (d / "e1" / f"pp{c}-of-2" / "ep0-of-1").exists()
        joined = [consolidated(d / name, d / f"{name}.npz") for name in ("a", "e1")]    # both at step 2
    assert list(joined[0]) == list(joined[1]) and "block1.experts.fc.w" in joined[0]
    assert joined[0]["block1.experts.fc.w"].shape == (4, 16, 24)
    assert all(np.array_equal(joined[0][n], joined[1][n]) for n in joined[0])
    full = runs[0]
    assert full["moe"]["ep"] == 2 and full["pipeline"] is not None
    for resumed, whole in ((runs[2], full), (runs[3], full), (runs[4], full), (runs[7], runs[5]),
                           (runs[9], full), (runs[11], full)):
        assert resumed["first_step"] == 2 and resumed["losses"] == whole["losses"][2:]
        assert resumed["final_params_sha256"] == whole["final_params_sha256"]
        assert resumed["moe"]["bias"] == whole["moe"]["bias"]
    assert runs[10]["losses"] == full["losses"][:2]
    assert runs[5]["final_params_sha256"] != full["final_params_sha256"]
    assert any(v != 0 for b in runs[5]["moe"]["bias"].values() for v in b)


def test_ep_must_divide_a_stages_ranks():
    cfg = parse_config(FLAGS + ["--ep", "4", "--pp", "2", "--batch", "16"], environ={})
    with pytest.raises(ConfigError) as e:
        cfg.check_world(4)
    assert str(e.value).startswith("ep=4 does not divide the 2 data-parallel ranks of each pipeline stage"), e.value
    cfg.check_world(8)


def test_ep_must_divide_a_stages_dp_sp_ranks():
    """With --sp the EP groups are over each stage's data- and sequence-parallel ranks (as without --pp)."""
    cfg = parse_config(FLAGS + ["--ep", "4", "--pp", "2", "--sp", "2", "--batch", "16"], environ={})
    with pytest.raises(ConfigError) as e:
        cfg.check_world(4)
    assert str(e.value).startswith("ep=4 does not divide the 2 data- and sequence-parallel ranks of each pipeline "
                                   "stage"), e.value
    cfg.check_world(8)


def test_sequence_parallel_stages():
    """N=8 --pp 2 --sp 2 --ep 2 against N=4 --sp 2 --ep 2: each stage's EP groups are K consecutive ranks of its
    data- and sequence-parallel ranks (each SP rank's chunk a source of its own), as without --pp: the same bits,
    stages 0 and 3."""
    configs = [FLAGS + EP + ["--sp", "2", "--stage", s, "--dtype", "fp32"] for s in ("0", "3")]
    flat = run_many(4, configs)
    piped = run_many(8, [c + ["--pp", "2"] for c in configs], timeout=600)
    assert len(flat) == len(piped) == 2
    for a, b in zip(flat, piped):
        same_bits(a, b)
        assert b["pipeline"]["sp"] == 2
        m = b["moe"]
        assert m["memory_bytes_by_engine"]["experts"]["ranks"] == 2      # 4 DP x SP ranks per stage, EP 2
        assert sum(m["all_to_all_bytes"]) * 2 == sum(a["moe"]["all_to_all_bytes"])
        assert m["all_to_all_theory_bytes"] * 2 == a["moe"]["all_to_all_theory_bytes"]
        dense = m["memory_bytes_by_engine"]["dense"]
        assert dense["measured"] == dense["theory"]
        assert b["comm_bytes_per_step"] == b["comm_theory_bytes_per_step"]
    assert flat[0]["final_params_sha256"] == flat[1]["final_params_sha256"]


@pytest.mark.slow
def test_sequence_parallel_stages_capacity_fp16_zb_h1():
    """The same with a capacity (decided over the whole sequences from every SP rank's choices), fp16, ZB-H1 and
    interleaved (--moe-every 2: a stage without MoE blocks), stage 2."""
    flags = list(FLAGS)
    flags[flags.index("--n-layer") + 1] = "4"
    flags += EP + ["--sp", "2", "--moe-every", "2", "--capacity-factor", "1.0", "--stage", "2", "--dtype", "fp16"]
    flat = run_many(4, [flags])
    piped = run_many(8, [flags + ["--pp", "2"] + s for s in (["--schedule", "zb-h1"],
                                                             ["--schedule", "interleaved", "--chunks", "2"])],
                     timeout=600)
    assert len(flat) == 1 and len(piped) == 2
    assert sum(flat[0]["moe"]["dropped"]) > 0
    for b in piped:
        same_bits(flat[0], b)


@pytest.mark.slow
def test_tensor_parallel_stages():
    """N=8 --tp 2 --pp 2 --ep 2 (each TP rank's EP group in its stage) against N=4 --tp 2 --ep 2: the same bits."""
    config = FLAGS + EP + ["--tp", "2", "--stage", "2", "--dtype", "fp16"]
    flat = run_many(4, [config])
    piped = run_many(8, [config + ["--pp", "2"]], timeout=600)
    assert len(flat) == len(piped) == 1
    same_bits(flat[0], piped[0])


def routed(mode, flags, n=4):
    proc = run_mpi(n, ["tests/drivers/moe_routing.py", mode, json.dumps(flags)], timeout=240)
    runs = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(runs) == 1
    return runs[0]["moe"]


def forced_routing_ends(stages):
    """Every token to expert 0, or each rank's to expert (its world rank): the runs end (no rank skips an exchange);
    per-rank: a stage's 2 ranks send their block's 96 tokens to 2 experts, 48 each."""
    for mode, expected in (("one", (0, 96)), ("per-rank", (0, 48))):
        for stage in stages:
            moe = routed(mode, FLAGS + EP + ["--pp", "2", "--stage", str(stage), "--top-k", "1"])
            assert (moe["tokens_min"][-1], moe["tokens_max"][-1]) == expected, (mode, stage)


def test_forced_routing_ends():
    forced_routing_ends((3,))


@pytest.mark.slow
def test_forced_routing_ends_at_every_stage():
    forced_routing_ends((0, 1, 2))


def test_all_to_all_bytes_equal_the_formula():
    """Exactly balanced routing (token i to expert i mod E, top-1): each rank sends its stage's block's formula
    bytes, the mean over the ranks the formula over both blocks / 2."""
    flags = FLAGS + EP + ["--pp", "2", "--stage", "1", "--top-k", "1", "--micro-batches", "3"]
    moe = routed("cycle", flags)
    assert moe["tokens_min"] == moe["tokens_max"] == [24] * 3
    # 1 block per stage x 3 micro-batches x ((2-1)·2·8 + 4 x 16·1·(1/2) x 16 x 4 B), 16 tokens per micro-batch
    assert moe["all_to_all_theory_bytes"] == 3 * (16 + 4 * 8 * 16 * 4)
    assert moe["all_to_all_bytes"] == [moe["all_to_all_theory_bytes"]] * 3


@pytest.mark.slow
def test_recompute_capacity_bias_and_gather_per_step():
    """--checkpoint-activations (the exchanges made again in the backward), --capacity-factor (drops), --bias-update
    (the selection biases from the step's global counts) and stage 3's --pp-gather step: the unpipelined bits."""
    base = FLAGS + EP + ["--stage", "3"]
    extra = [["--checkpoint-activations"], ["--capacity-factor", "1.0"], ["--bias-update", "0.01"]]
    flat = run_many(2, [base + e for e in extra] + [base])
    piped = run_many(4, [base + e + ["--pp", "2"] for e in extra] + [base + ["--pp", "2", "--pp-gather", "step"]])
    assert len(flat) == len(piped) == 4
    for a, b in zip(flat, piped):
        same_bits(a, b)
        assert a["moe"]["bias"] == b["moe"]["bias"]
    assert sum(flat[1]["moe"]["dropped"]) > 0 and any(v != 0 for b in flat[2]["moe"]["bias"].values() for v in b)


def test_a_missing_or_other_step_part_is_refused(tmp_path):
    """A chunk's EP part missing at the resumed step, or of another step: refused on every rank in one line,
    nothing loaded."""
    import shutil
    F = FLAGS[:FLAGS.index("--steps")] + ["--pp", "2", "--ep", "2", "--stage", "1", "--steps"]
    assert len(run_many(4, [F + ["2", "--save-dir", str(tmp_path / "a"), "--save-every", "1"]])) == 1
    part = tmp_path / "a" / "pp1-of-2" / "ep1-of-2"
    shutil.rmtree(part / "step_000002")
    resume = ["-m", "zerompi.train", *F, "4", "--resume", tmp_path / "a"]
    proc = run_mpi(4, resume, timeout=120, check=False)
    assert proc.returncode != 0 and "pp1-of-2/ep1-of-2/step_000002: does not exist" in proc.stderr, proc.stderr
    assert len(set(proc.stderr.strip().splitlines())) == 1, proc.stderr          # one line (on every rank)
    shutil.copytree(part / "step_000001", part / "step_000002")
    proc = run_mpi(4, resume, timeout=120, check=False)
    assert proc.returncode != 0 and "its EP parts are of different steps" in proc.stderr, proc.stderr
    assert len(set(proc.stderr.strip().splitlines())) == 1, proc.stderr


@pytest.mark.slow
def test_resume_at_another_world_size_and_ep(tmp_path):
    """N=4 --pp 2 --ep 2 saved at step 2, resumed at N=8 --pp 2 --ep 4 (each stage's 4 ranks one EP group) and
    --ep 2 (two groups): the losses of the N=4 run that never stopped to 1e-5 relative (the promise of a resume
    at another world size: the gradients are summed over other groups of ranks; measured 0 and 1.2e-7); the two
    N=8 resumes the same bits."""
    F = FLAGS[:FLAGS.index("--batch")] + ["--batch", "16"] + FLAGS[FLAGS.index("--batch") + 2:FLAGS.index("--steps")]
    F += ["--pp", "2", "--stage", "2", "--steps"]
    n4 = run_many(4, [F + ["4", "--ep", "2"], F + ["2", "--ep", "2", "--save-dir", str(tmp_path / "a")]])
    n8 = run_many(8, [F + ["4", "--ep", k, "--resume", str(tmp_path / "a")] for k in ("4", "2")], timeout=600)
    assert len(n4) == 2 and len(n8) == 2
    assert n8[0]["final_params_sha256"] == n8[1]["final_params_sha256"]      # --ep 4 and --ep 2: the same bits
    for resumed in n8:
        assert resumed["first_step"] == 2 and resumed["world_size"] == 8
        assert resumed["losses"] == pytest.approx(n4[0]["losses"][2:], rel=1e-5)


def test_checkpoints_with_sequence_parallel():
    """N=8 --pp 2 --sp 2 --ep 2 saved at step 2, resumed at --ep 2 and --ep 1 to step 4: the bits of the run that
    never stopped (the expert engines over each stage's DP x SP ranks save and load as without --sp)."""
    import tempfile
    F = FLAGS[:FLAGS.index("--steps")] + ["--pp", "2", "--sp", "2", "--stage", "3", "--steps"]
    with tempfile.TemporaryDirectory() as d:
        runs = run_many(8, [F + ["4", "--ep", "2"], F + ["2", "--ep", "2", "--save-dir", d + "/a"],
                            F + ["4", "--ep", "2", "--resume", d + "/a"], F + ["4", "--ep", "1", "--resume", d + "/a"]],
                        timeout=600)
    assert len(runs) == 4 and runs[0]["sequence_parallel"] is not None
    for resumed in runs[2:]:
        assert resumed["first_step"] == 2 and resumed["losses"] == runs[0]["losses"][2:]
        assert resumed["final_params_sha256"] == runs[0]["final_params_sha256"]


def test_checkpoints_keep_the_biases_at_ep_1_with_tensor_parallelism():
    """--pp 2 --tp 2 at --ep 1 with --bias-update (the refusal of the pipeline's checkpoints with biases lifted):
    saved at step 2, resumed to step 4, the bits and biases of the run that never stopped."""
    import tempfile
    F = FLAGS[:FLAGS.index("--steps")] + ["--pp", "2", "--tp", "2", "--stage", "2", "--bias-update", "0.01", "--steps"]
    with tempfile.TemporaryDirectory() as d:
        runs = run_many(4, [F + ["4"], F + ["2", "--save-dir", d + "/a"], F + ["4", "--resume", d + "/a"]])
    assert len(runs) == 3 and runs[0]["moe"]["ep"] == 1 and runs[0]["tensor_parallel"] is not None
    assert any(v != 0 for b in runs[1]["moe"]["bias"].values() for v in b)        # biases at the save, not zero
    assert runs[2]["first_step"] == 2 and runs[2]["losses"] == runs[0]["losses"][2:]
    assert runs[2]["final_params_sha256"] == runs[0]["final_params_sha256"]
    assert runs[2]["moe"]["bias"] == runs[0]["moe"]["bias"]


@pytest.mark.slow
def test_checkpoints_with_tp_resume_at_the_same_and_another_ep():
    """N=8 --pp 2 --tp 2 --ep 2 saved after step 2: each TP rank's copy of its chunk's experts (replicated over TP)
    in pp{c}-of-2/tp{r}-of-2/ep{j}-of-2 beside its dense checkpoint; resumed to step 4 at --ep 2 and at --ep 1: the
    bits of the run that never stopped. Consolidated: the --ep 1 save's names, shapes and values. And the same
    unpipelined (N=4 --tp 2 --ep 2: tp{r}-of-2/ep{j}-of-2; before, both TP ranks wrote one ep{j}-of-2 and the save
    failed)."""
    import tempfile
    from pathlib import Path
    F = FLAGS[:FLAGS.index("--steps")] + ["--eval-every", "4", "--stage", "3", "--tp", "2", "--batch", "16", "--steps"]
    at = lambda ep, pp=2: ["--pp", str(pp), "--ep", str(ep)] if pp > 1 else ["--ep", str(ep)]   # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        runs = run_many(8, [
            F + ["4"] + at(2),                                                    # 0: never stopped
            F + ["2"] + at(2) + ["--save-dir", str(d / "a")],                    # 1
            F + ["4"] + at(2) + ["--resume", str(d / "a")],                      # 2
            F + ["4"] + at(1) + ["--resume", str(d / "a")],                      # 3: another --ep
            F + ["2"] + at(1) + ["--save-dir", str(d / "e1")],                   # 4: an --ep 1 save
        ], timeout=900)
        flat = run_many(4, [
            F + ["4"] + at(2, 1),                                                 # 0: never stopped
            F + ["2"] + at(2, 1) + ["--save-dir", str(d / "f")],                 # 1
            F + ["4"] + at(2, 1) + ["--resume", str(d / "f")],                   # 2
            F + ["4"] + at(1, 1) + ["--resume", str(d / "f")],                   # 3
            F + ["2"] + at(1, 1) + ["--save-dir", str(d / "f1")],                # 4
        ], timeout=900)
        assert len(runs) == len(flat) == 5
        for c in range(2):
            for r in range(2):
                for j in range(2):
                    assert (d / "a" / f"pp{c}-of-2" / f"tp{r}-of-2" / f"ep{j}-of-2" / "step_000002").is_dir()
                    assert (d / "f" / f"tp{r}-of-2" / f"ep{j}-of-2" / "step_000002").is_dir()
        assert not any(p.name.startswith("ep") for p in (d / "f").iterdir())
        for a, b in (("a", "e1"), ("f", "f1")):
            joined = [consolidated(d / name, d / f"{name}.npz") for name in (a, b)]
            assert list(joined[0]) == list(joined[1]) and "block1.experts.fc.w" in joined[0]
            assert joined[0]["block1.experts.fc.w"].shape == (4, 16, 24)
            assert all(np.array_equal(joined[0][n], joined[1][n]) for n in joined[0])
    for got in (runs, flat):
        full = got[0]
        for resumed in got[2:4]:
            assert resumed["first_step"] == 2 and resumed["losses"] == full["losses"][2:]
            assert resumed["final_params_sha256"] == full["final_params_sha256"]
