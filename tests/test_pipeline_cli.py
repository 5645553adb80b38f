"""``zerompi.train --pp``: checkpoints per stage (consolidate, resume at another data-parallel size), the
trace of the schedule, bad input (one line, exit 2, every rank), and a failing stage ending the job."""
import json
import time

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, one_line, run_mpi, run_train

GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "0", "--micro-batches", "4", "--dtype", "fp32", "--stage", "2", "--log-every", "1000"]


def consolidate(path, out):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "consolidate", str(path), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT), env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    return dict(np.load(out))


def test_checkpoints_per_stage_consolidate_and_resume_at_another_dp_size(tmp_path):
    """dp 2 x pp 2 saves every chunk (pp{c}-of-2); consolidated, it is the unpipelined run's checkpoint, names,
    shapes and bits; resumed on dp 1 x pp 2 it continues the unpipelined run within 1e-5."""
    piped = run_train(4, tmp_path, *GPT, "--steps", "4", "--pp", "2", "--schedule", "zb-h1",
                      "--save-dir", tmp_path / "pp", tag="pp")
    plain = run_train(2, tmp_path, *GPT, "--steps", "6", "--save-every", "4", "--save-dir", tmp_path / "plain",
                      tag="plain")
    assert sorted(p.name for p in (tmp_path / "pp").iterdir() if p.is_dir()) == ["pp0-of-2", "pp1-of-2"]
    a = consolidate(tmp_path / "pp", tmp_path / "a.npz")
    b = consolidate(tmp_path / "plain" / "step_000004", tmp_path / "b.npz")
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape and np.array_equal(a[k], b[k]) for k in a)
    assert piped["losses"] == plain["losses"][:4]
    resumed = run_train(2, tmp_path, *GPT, "--steps", "6", "--pp", "2", "--resume", tmp_path / "pp", tag="resumed")
    assert resumed["first_step"] == 4 and len(resumed["losses"]) == 2
    assert resumed["losses"] == pytest.approx(plain["losses"][4:], rel=1e-5)
    bad = run_mpi(2, ["-m", "zerompi.train", *GPT, "--steps", "6", "--resume", tmp_path / "pp"], check=False)
    one_line(bad, 2, "a pipeline save (pp0-of-2, ...: 2 model chunks)")


def test_a_pipelined_save_killed_before_its_rename_is_published_by_the_next_run(tmp_path):
    """Every chunk's shards of step 4 written, the job killed before any rename: inspect names the
    unpublished checkpoint in each chunk's folder, and the next run into the folder publishes step 4 in
    every chunk (pp{c}-of-2/.tmp-..., one step of all chunks) and resumes from it."""
    from tests.test_checkpoint import checkpoint_cli
    from zerompi.checkpoint.pointer import latest_name
    ck = tmp_path / "ck"
    common = ["-m", "zerompi.train", *GPT, "--pp", "2", "--save-every", "2", "--save-dir", ck]
    proc = run_mpi(2, [*common, "--steps", "4"], check=False, env={"ZEROMPI_CHECKPOINT_CRASH": "after_shards@4:all"})
    assert proc.returncode != 0
    assert [latest_name(ck / f"pp{c}-of-2") for c in (0, 1)] == ["step_000002"] * 2
    note = checkpoint_cli("inspect", ck / "pp1-of-2").stdout
    assert "holds a complete checkpoint of step 4 that was never published" in note, note
    proc = run_mpi(2, [*common, "--steps", "6", "--resume", ck])
    assert proc.stderr.count("published ") == 2, proc.stderr        # one line per chunk
    for c in (0, 1):
        chunk = ck / f"pp{c}-of-2"
        assert sorted(p.name for p in chunk.iterdir()) == ["latest", "step_000002", "step_000004", "step_000006"]


def test_the_trace_shows_the_schedule(tmp_path):
    m = run_train(2, tmp_path, *GPT, "--steps", "3", "--pp", "2", "--schedule", "zb-h1", "--trace",
                  tmp_path / "t.json", "--trace-steps", "2")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    work = {(e["pid"], e["name"]) for e in spans if e["cat"] == "schedule"}
    for mb in range(4):               # every F, B and W of the two kept steps, on its stage
        assert (0, f"F{mb} c0") in work and (1, f"B{mb} c1") in work and (1, f"W{mb} c1") in work
    assert sum(1 for e in spans if e["cat"] == "schedule") == 2 * 2 * 3 * 4
    assert any(e["cat"] == "idle (bubble)" for e in spans)
    sent = {e["name"] for e in spans if e["cat"] == "messages"}
    assert {"send activations to stage 1", "receive activations from stage 0", "send tied weight to stage 0",
            "receive activation gradients from stage 1"} <= sent
    assert m["bubble_fraction"] is not None


BAD = [
    (4, ["--pp", "3", "--n-layer", "3"], "pp=3 does not divide the 4 ranks left by tp=1; use a divisor of 4"),
    (2, ["--pp", "2", "--n-layer", "3"], "pp=2 does not divide n_layer=3"),
    (2, ["--pp", "2", "--schedule", "interleaved", "--chunks", "3"],
     "chunks=3 does not divide the 2 blocks per stage (n_layer=4, pp=2); use a divisor of 2"),
    (2, ["--pp", "2", "--micro-batches", "1", "--batch", "2"],
     "micro_batches=1 is too few for the 1f1b schedule on 2 stages; it needs at least 2 (the ranks) micro-batches"),
    (1, ["--schedule", "zb-h1"], "--schedule zb-h1 applies with --pp > 1 only"),
    (2, ["--pp", "2", "--pp-gather", "step"], "gather='step' (--pp-gather) applies with stage 3 only"),
]


@pytest.mark.parametrize("n,flags,needle", BAD)
def test_bad_input_is_one_line_and_exit_2(n, flags, needle):
    proc = run_mpi(n, ["-m", "zerompi.train", *GPT, "--steps", "1", *flags], check=False, timeout=60)
    one_line(proc, 2, needle)


def test_a_bad_schedule_file_and_ranks_that_disagree(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0SEND_F0,0F1\n1X1\n")
    proc = run_mpi(2, ["-m", "zerompi.train", *GPT, "--steps", "1", "--pp", "2", "--schedule-file", bad], check=False)
    one_line(proc, 2, "line 2 (rank 1): '1X1' is not an action")
    from zerompi.pipeline import actions, schedules
    short = tmp_path / "short.csv"
    actions.write(schedules.make("1f1b", 2, 2), str(short))
    proc = run_mpi(2, ["-m", "zerompi.train", *GPT, "--steps", "1", "--pp", "2", "--schedule-file", short], check=False)
    one_line(proc, 2, "it has 2 micro-batches, this run has 4")
    from tests.mpirun import mpiexec
    import subprocess
    import sys
    common = [sys.executable, "-m", "zerompi.train", *GPT, "--steps", "1", "--pp", "2"]
    proc = subprocess.run([mpiexec(), "-n", "1", *common, "--schedule", "1f1b", ":", "-n", "1", *common, "--schedule",
                           "gpipe"], capture_output=True, text=True, timeout=60, env=mpi_env(), cwd=str(ROOT))
    one_line(proc, 2, "configuration mismatch between ranks: "
                      "pipeline.schedule = \"1f1b\" on rank 0, \"gpipe\" on rank 1")


@pytest.mark.parametrize("kind", ["raise", "hang"])
def test_a_failing_stage_ends_the_whole_job(kind):
    """The last stage fails in step 2's first backward: an exception ends every rank at once; a hang is found by
    stage 0's watchdog, waiting for the gradient (the pipeline's waits are timed), well before the test's timeout."""
    t = time.perf_counter()
    proc = run_mpi(2, [ROOT / "tests" / "drivers" / "pipeline_fail.py", kind, *GPT, "--steps", "4", "--pp", "2",
                       "--timeout-s", "5"], check=False, timeout=90)
    assert proc.returncode != 0 and time.perf_counter() - t < 60, proc.stderr[-2000:]
    if kind == "raise":
        assert "injected failure on the last stage" in proc.stderr
    else:
        waited = "pipeline: activation gradients of micro-batch 0 for chunk 0 from stage 1"
        assert waited in proc.stderr, proc.stderr[-2000:]


def test_grad_reduce_per_step_keeps_the_bits_at_dp_1_in_fp32_only(tmp_path):
    """docs/pipeline.md: at dp 1, --pp-grad-reduce step gives the default's bits in fp32 (a reduce-scatter over one
    rank is a power-of-two scaling, the micro-batches are added in float32 either way); in fp16 and bf16 not (the
    default rounds each micro-batch's reduced gradient to the storage dtype before adding it)."""
    flags = ["--pp", "2", "--micro-batches", "4", "--batch", "8", "--steps", "3", "--n-layer", "2", "--eval-every", "0",
             "--progress", "lines"]
    for dtype in ("fp32", "fp16", "bf16"):
        per = {mode: run_train(2, tmp_path, *flags, "--dtype", dtype, "--pp-grad-reduce", mode, tag=f"{dtype}-{mode}")
               for mode in ("micro-batch", "step")}
        a, b = per["micro-batch"], per["step"]
        same = (a["final_params_sha256"], a["losses"]) == (b["final_params_sha256"], b["losses"])
        assert same == (dtype == "fp32"), dtype
        assert a["losses"][0] == b["losses"][0] and np.allclose(a["losses"], b["losses"], rtol=1e-4), dtype
