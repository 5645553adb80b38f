"""Muon through the train CLI: pipelined = unpipelined, checkpoints that carry its state by name
(saved at N = 4 stage 3, resumed at N = 4 stage 1 to the same bits and at N = 2 stage 1 within the
reduction-order tolerance of AdamW's own resume, tests/test_checkpoint.py), consolidate writing the
state by name, and bad input in one line (exit 2)."""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, one_line, run_mpi, run_train
from tests.test_checkpoint import checkpoint_cli

GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "2", "--bucket-mb", "0.01", "--log-every", "1000", "--optimizer", "muon"]
FP32 = ["--dtype", "fp32", "--clip", "0.5", "--steps", "3", "--micro-batches", "4"]


def launch(n, configs):
    out = run_mpi(n, [ROOT / "tests" / "drivers" / "train_many.py", json.dumps(configs)], timeout=600).stdout
    runs = [json.loads(line[8:]) for line in out.splitlines() if line.startswith("METRICS ")]
    assert len(runs) == len(configs)
    return runs


def facts(m):
    return m["final_params_sha256"], m["losses"], m.get("val_losses")


def test_pipelined_is_unpipelined():
    """--pp 2 (an engine per chunk, each with the matrices of its chunk) on 4 ranks = 2 data-parallel ranks."""
    ref = launch(2, [GPT + FP32 + ["--stage", s] for s in ("1", "3")])
    pp = launch(4, [GPT + FP32 + ["--stage", s, "--pp", "2", "--schedule", "1f1b"] for s in ("1", "3")])
    assert facts(ref[0]) == facts(ref[1])        # stages bit-identical
    for a, b in zip(ref, pp):
        assert facts(a) == facts(b)
    # interleaved (2 chunks per stage, 4 engines) on 2 ranks = 1 rank unpipelined
    one = launch(1, [GPT + FP32 + ["--stage", "0"]])
    two = launch(2, [GPT + FP32 + ["--stage", "3", "--pp", "2", "--schedule", "interleaved", "--chunks", "2"]])
    assert facts(one[0]) == facts(two[0])


def test_checkpoint_resumes_at_another_stage_and_world_size(tmp_path):
    base = [*GPT, "--dtype", "fp32", "--batch", "8", "--steps", "6", "--eval-every", "0"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    whole = run_train(4, tmp_path, *base, "--stage", "3", "--save-dir", a, "--save-every", "3", tag="whole")
    same_n = run_train(4, tmp_path, *base, "--stage", "1", "--resume", a / "step_000003", "--save-dir", b,
                       tag="same")
    assert same_n["final_params_sha256"] == whole["final_params_sha256"]   # the bits of the run that never stopped
    assert same_n["losses"] == whole["losses"][3:]
    run_train(2, tmp_path, *base, "--stage", "1", "--resume", a / "step_000003", "--save-dir", c, tag="other")
    ref, got, start = (_state(tmp_path, d / f"step_00000{s}", tag) for d, s, tag in
                       ((a, 6, "ref"), (c, 6, "got"), (a, 3, "start")))
    worst = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    moved = max(float(np.max(np.abs(ref[k] - start[k]))) for k in ref if "/" not in k)
    assert worst <= 5e-6 and moved > 100 * 5e-6, (worst, moved)   # only the sums' order differs across N


def _state(tmp_path, ckpt, tag):
    proc = checkpoint_cli("consolidate", ckpt, tmp_path / f"{tag}.npz", "--state")
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / f"{tag}.npz")
    return {k: got[k] for k in got.files}


def test_tensor_parallel_pieces_are_matrices_of_their_own():
    """--tp 2: each TP rank's piece of a split weight is orthogonalised alone; stages 1 and 3 the same bits."""
    runs = launch(4, [GPT + FP32 + ["--stage", s, "--tp", "2"] for s in ("1", "3")])
    assert facts(runs[0]) == facts(runs[1])


def test_consolidate_writes_the_state_by_name(tmp_path):
    m = run_train(2, tmp_path, *GPT, "--dtype", "fp32", "--steps", "2", "--stage", "2", "--save-dir", tmp_path / "a",
              "--save-every", "2")
    s = _state(tmp_path, tmp_path / "a" / "step_000002", "s")
    assert {"block0.qkv.w", "momentum/block0.qkv.w", "exp_avg/wte", "exp_avg_sq/block0.qkv.b"} <= set(s)
    assert np.any(s["momentum/block0.qkv.w"]) and not np.any(s["exp_avg/block0.qkv.w"])   # Muon's matrices
    assert np.any(s["exp_avg/wte"]) and not np.any(s["momentum/wte"])                     # AdamW's embedding
    manifest = json.loads((tmp_path / "a" / "step_000002" / "manifest.json").read_text())
    # the memory table's optimizer row: the ledger's bytes = the formula's, 4 (1 + 3 rows) per element of the shard
    assert m["memory_bytes"]["optimizer"] == m["theory_bytes_padded"]["optimizer"] == 16 * manifest["shard_numel"]
    assert manifest["optimizer"]["name"] == "muon"
    assert manifest["optimizer"]["state"] == ["master", "momentum", "exp_avg", "exp_avg_sq"]


@pytest.fixture(scope="module")
def muon_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("muon")
    run_train(2, d, *GPT, "--dtype", "fp32", "--steps", "2", "--stage", "1", "--save-dir", d / "a", "--save-every", "2")
    return d / "a" / "step_000002"


def test_resuming_with_another_optimizer_is_refused_or_fresh(tmp_path, muon_checkpoint):
    plain = [f for f in GPT if f not in ("--optimizer", "muon")]
    args = ["-m", "zerompi.train", *plain, "--dtype", "fp32", "--steps", "3", "--resume", muon_checkpoint]
    one_line(run_mpi(2, args, check=False), 2, "saved by optimizer 'muon'", "--fresh-optimizer-state")
    m = run_train(2, tmp_path, *args[2:], "--fresh-optimizer-state")
    assert len(m["losses"]) == 1 and np.isfinite(m["losses"][0])


@pytest.mark.parametrize("flags,needles", [
    (["--optimizer", "sgd"], ["optimizer='sgd'", "adamw, muon"]),
    (["--optimizer", "muon", "--muon-params", "nothing*"], ["'nothing*'", "matches no parameter"]),
    (["--optimizer", "muon", "--muon-params", "*.b"], ["match no 2-D parameter"]),
    (["--muon-params", "*.w"], ["--muon-params", "applies with --optimizer muon only"]),
    (["--optimizer", "muon", "--stage", "2", "--offload-optimizer", "cpu"], ["offload_optimizer='cpu'", "muon"]),
])
def test_bad_input_is_one_line(flags, needles):
    plain = [f for f in GPT if f not in ("--optimizer", "muon")]
    one_line(run_mpi(2, ["-m", "zerompi.train", *plain, "--steps", "1", *flags], check=False), 2, *needles)


def test_fp16_skips_and_clipping_keep_stages_bit_identical():
    """fp16 with a loss scale that overflows (steps skipped on every rank) and clipping: stages 0, 2, 3 alike."""
    fp16 = ["--dtype", "fp16", "--loss-scale", "262144", "--loss-scale-window", "2", "--clip", "0.5", "--steps", "5",
            "--micro-batches", "2"]
    runs = launch(2, [GPT + fp16 + ["--stage", s] for s in ("0", "2", "3")])
    assert runs[0]["steps_applied"] < 5                   # some steps were skipped
    assert facts(runs[0]) == facts(runs[1]) == facts(runs[2])


def test_simulated_world_is_refused_in_one_line():
    plain = [f for f in GPT if f not in ("--optimizer", "muon")]
    proc = run_mpi(1, ["-m", "zerompi.train", *plain, "--steps", "1", "--optimizer", "muon", "--stage", "3",
                       "--simulate-world", "8", "--simulate-rank", "1"], check=False)
    one_line(proc, 2, "optimizer='muon'", "simulated world")


def test_the_estimate_prices_the_optimizer_rows(tmp_path):
    """estimate(optimizer=...) and a run's --from-run: Muon's 16 bytes per parameter against AdamW's 12."""
    import zerompi
    from zerompi.engine.config import ZeroConfig
    from zerompi.estimate.fromrun import run_estimate
    adamw = zerompi.estimate(10 ** 6, 4, layers=8)["stages"]
    muon = zerompi.estimate(10 ** 6, 4, layers=8, zero=ZeroConfig(optimizer="muon"))["stages"]
    assert [12 * m["optimizer_bytes"] for m in muon] == [16 * a["optimizer_bytes"] for a in adamw]
    assert muon[1]["formula"] == "4Ψ + 16Ψ/N"
    m = run_train(2, tmp_path, *GPT, "--dtype", "fp32", "--steps", "1", "--stage", "1")
    est = run_estimate(m)
    assert est["optimizer"] == "muon"
    assert est["stages"][1]["optimizer_bytes"] == pytest.approx(m["memory_bytes"]["optimizer"], rel=0.02)


def test_an_older_adamw_checkpoint_loads_by_its_rows_and_muon_starts_fresh_from_it(tmp_path):
    """A manifest without the optimizer's name and row names (format 1, as older zerompi wrote it) is AdamW's:
    the resume gives the bits of the run that never stopped; Muon refuses it, or starts its state fresh."""
    import hashlib
    plain = [f for f in GPT if f not in ("--optimizer", "muon")] + ["--dtype", "fp32", "--eval-every", "0"]
    a = tmp_path / "a"
    whole = run_train(2, tmp_path, *plain, "--steps", "4", "--stage", "1", "--save-dir", a, "--save-every", "2",
                      tag="whole")
    ck = a / "step_000002"
    m = json.loads((ck / "manifest.json").read_text())
    del m["manifest_sha256"], m["optimizer"]["name"], m["optimizer"]["state"]
    m["format_version"] = 1
    for s in m["shards"]:
        s["sha256"] = hashlib.sha256((ck / s["file"]).read_bytes()).hexdigest()
        del s["crc32"]
    (ck / "manifest.json").write_text(json.dumps(m, indent=1))
    resumed = run_train(2, tmp_path, *plain, "--steps", "4", "--stage", "3", "--resume", ck, tag="resumed")
    assert resumed["final_params_sha256"] == whole["final_params_sha256"]
    args = ["-m", "zerompi.train", *plain, "--steps", "4", "--optimizer", "muon", "--resume", ck]
    one_line(run_mpi(2, args, check=False), 2, "saved by optimizer 'adamw'", "this run's is 'muon'")
    fresh = run_train(2, tmp_path, *args[2:], "--fresh-optimizer-state", tag="fresh")
    assert len(fresh["losses"]) == 2 and fresh["final_params_sha256"] != whole["final_params_sha256"]
    assert fresh["losses"][0] == whole["losses"][2]      # the loaded parameters: step 3's loss, before its update


@pytest.mark.slow
def test_the_owners_exchange_is_measured_beside_its_formula():
    """The bytes that bring each matrix to its owner and back, counted from what is handed to MPI, equal the plan's
    count; stage 0 sends none; at most every matrix element out and back (4 bytes each); the memory row's formula
    is Muon's 16 bytes per parameter; an AdamW run has no muon section."""
    three = ["--batch", "9"]
    runs = launch(3, [GPT + three + ["--steps", "3", "--stage", s] for s in ("0", "1", "3")] + [GPT[:-2] + three])
    d, layers = 32, 4
    matrix_numel = layers * (d * 3 * d + d * d + d * 4 * d + 4 * d * d)    # qkv, projection, fc, out
    for m in runs[1:3]:
        mu = m["muon"]
        assert mu["matrices"] == 4 * layers and 0 < mu["owned"] < mu["matrices"]
        assert mu["exchange_bytes_per_step"] == mu["exchange_bytes_formula"] > 0
        assert mu["exchange_bytes_formula"] <= 2 * 4 * matrix_numel
    assert runs[0]["muon"]["exchange_bytes_per_step"] == runs[0]["muon"]["exchange_bytes_formula"] == 0
    assert runs[3]["muon"] is None
    proc = run_mpi(2, ["-m", "zerompi.train", *GPT, "--steps", "1", "--stage", "3"], timeout=300)
    assert "optimizer" in proc.stdout and "16Ψ/N" in proc.stdout and "muon on the 2-D parameters named *.w" \
        in proc.stdout, proc.stdout
