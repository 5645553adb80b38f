"""One job: a run without --pp and a pipelined run are one driver, one report, one metrics schema.

The oracle is the schema itself: a pipelined and an unpipelined run of the same model write the same
top-level keys (and the same keys inside the entries that are one concept in both), the pipeline's facts
null without --pp; the tools that read a metrics file (zerompi.plot, zerompi.estimate --from-run) read a
pipelined run's as an unpipelined one's; the final metrics' fault point fires under --pp too.
"""
import json
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, mpi_env, run_mpi

DRIVER = ROOT / "tests" / "drivers" / "train_many.py"
GPT = ["--model", "gpt", "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "4",
       "--micro-batches", "2", "--steps", "2", "--eval-every", "2", "--bucket-mb", "0.002", "--log-every", "1000"]
MLP = ["--model", "mlp", "--width", "16", "--depth", "4", "--batch", "8", "--micro-batches", "2", "--bucket-mb",
       "0.002", "--steps", "2"]
PIPELINE_ONLY = ("pipeline", "bubble_fraction", "bubble_fraction_schedule", "bubble_fraction_replayed",
                 "bubble_fraction_unit",
                 "peak_activations_schedule", "pp_bytes_per_step", "pp_theory_bytes_per_step")
SAME_CONCEPT = ("memory_bytes", "memory_bytes_by_place", "theory_bytes", "theory_bytes_padded", "theory_bytes_by_place",
                "comm_bytes_per_step_by_level", "comm_theory_bytes_per_step_by_level", "comm_check_bytes", "topology",
                "quantization", "config", "offload", "time_breakdown_s", "step_breakdown_s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The GPT on 2 ranks: unpipelined (2 data-parallel), pipelined (--pp 2); each writes its --metrics-json."""
    d = tmp_path_factory.mktemp("one_job")
    configs = [GPT + ["--stage", "3", "--metrics-json", str(d / "flat.json")],
               GPT + ["--stage", "3", "--pp", "2", "--metrics-json", str(d / "piped.json")]]
    run_mpi(2, [DRIVER, json.dumps(configs)], timeout=300)
    return {name: (d / f"{name}.json", json.loads((d / f"{name}.json").read_text())) for name in ("flat", "piped")}


def test_pipelined_and_unpipelined_runs_write_one_schema(runs):
    flat, piped = runs["flat"][1], runs["piped"][1]
    assert set(flat) == set(piped), (set(flat) ^ set(piped))
    for key in SAME_CONCEPT:
        assert type(flat[key]) is type(piped[key]), key
        if isinstance(flat[key], dict):
            assert set(flat[key]) == set(piped[key]), key
    for key in PIPELINE_ONLY:
        assert flat[key] is None and piped[key] is not None, key
    assert flat["tensor_parallel"] is flat["sequence_parallel"] is flat["simulated"] is None
    assert "tp_bytes_per_step" not in piped and "sp_bytes_per_step" not in piped     # one name per fact
    assert flat["params"] == piped["params"]                    # Ψ of the whole model in both


def test_plot_reads_a_pipelined_run(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.png"
    proc = subprocess.run([sys.executable, "-m", "zerompi.plot", str(runs["piped"][0]), "--out", str(out)],
                          capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert out.stat().st_size > 0


def test_estimate_from_a_pipelined_run_is_of_a_stage(runs):
    """The stage's chunks over its data-parallel ranks, not the whole model per rank (that estimate was twice
    the measured model states): within the padding the estimate cannot see (bucket boundaries of the GPT's
    layers, as for an unpipelined GPT run), under 2 %."""
    proc = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--from-run", str(runs["piped"][0])],
                          capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "of a rank of pipeline stage" in proc.stdout
    whole = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--from-run", str(runs["flat"][0])],
                           capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert whole.returncode == 0 and "pipeline stage" not in whole.stdout, whole.stderr
    row = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("model_state_bytes")][-1]
    measured, estimated = (int(v.replace(",", "")) for v in row[1:3])
    assert abs(measured - estimated) < 0.02 * measured, row


def test_metrics_fault_point_fires_under_pp():
    fault = "exit@rank1:step2:metrics"
    env = dict(mpi_env(), ZEROMPI_FAULT=fault)
    proc = run_mpi(2, ["-m", "zerompi.train", *MLP, "--stage", "2", "--pp", "2"], timeout=120, env=env, check=False)
    assert "injected fault 'exit' on rank 1 at step 2, before the final metrics' first collective" in proc.stderr, \
        proc.stderr
    assert proc.returncode != 0
