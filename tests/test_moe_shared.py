"""Shared experts (--shared-experts S): S always-on expert MLPs per MoE block, dense parameters (sharded over the
data-parallel group, not the expert engine's). At N=4, EP 1, 2, 4 and stages 0-3 are bit-identical (fp32 and
fp16), the gradient norm is the float64 single-process value (the shared experts a visible part of it), the
traffic and model states equal their formulas and the estimate's rows; checkpoints saved at --ep 2 resume at
--ep 4 and --ep 1 with the bits of the run that never stopped; under --tp 2 the shared experts are replicated
(bit-identical gradients on every TP rank, stages and EP sizes bit-identical, within 1e-5 of --tp 1); --pp 2
keeps the bits. tests/test_moe_model.py checks the model against the float64 oracle's finite differences."""
import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, run_mpi
from tests.test_estimate_flags import GPT, MOE_OPTS, cli_json
from tests.test_moe_ep import FLAGS, run_many, same_run
from tests.test_moe_parity import float64_mean_grads
from zerompi.train.data import GeneratedData

S = 2
SHARED = FLAGS + ["--shared-experts", str(S)]


@pytest.fixture(scope="module")
def n4():
    configs = [SHARED + ["--dtype", dtype, "--stage", str(stage), "--ep", str(ep)]
               for dtype in ("fp32", "fp16") for stage in range(4) for ep in (1, 2, 4)]
    configs.append(FLAGS + ["--dtype", "fp32", "--stage", "0", "--ep", "1"])        # without shared experts
    runs = run_many(4, configs)
    assert len(runs) == 25
    return runs[:-1], runs[-1]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.slow
def test_ep_sizes_and_stages_bit_identical(n4, dtype):
    runs = [m for m in n4[0] if m["dtype"] == dtype]
    assert {(m["stage"], m["moe"]["ep"]) for m in runs} == {(s, e) for s in range(4) for e in (1, 2, 4)}
    for m in runs:
        same_run(m, runs[0])
        assert m["moe"]["shared_experts"] == S
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]


@pytest.mark.slow
def test_shared_experts_are_dense_parameters(n4):
    """S·(2CH + H + C) more parameters per MoE block, all in the dense engine (the expert engine's are the
    routed experts' alone), and they change the run."""
    runs, plain = n4
    C, H = 16, 24
    extra = 2 * S * (2 * C * H + H + C)
    assert runs[0]["params"] == plain["params"] + extra
    assert runs[0]["losses"] != plain["losses"]
    from zerompi.estimate.moe_bytes import gpt_moe_params, moe_states
    dense, experts = gpt_moe_params(GeneratedData(8, 0).vocab, 8, C, 2, 4, H, shared=S)
    assert gpt_moe_params(GeneratedData(8, 0).vocab, 8, C, 2, 4, H)[0] == dense - extra
    for m in runs:
        assert m["params"] == dense + experts
        assert m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"], (m["stage"], m["moe"]["ep"])
        mem, ep = m["moe"]["memory_bytes_by_engine"], m["moe"]["ep"]
        if ep == 1:
            continue
        want = moe_states(m["stage"], 4 if m["dtype"] == "fp32" else 2, 4, ep, dense, experts)
        assert (mem["dense"]["params"], mem["experts"]["params"]) == (dense, experts // ep)
        assert mem["dense"]["theory"] == want["dense"]["total"] and mem["experts"]["theory"] == want["experts"]["total"]


@pytest.mark.slow
def test_grad_norm_counts_the_shared_experts_once(n4):
    total = float64_mean_grads(4, shared=S)
    want = float(np.sqrt(sum((v * v).sum() for v in total.values())))
    shared = float(np.sqrt(sum((v * v).sum() for k, v in total.items() if ".shared." in k)))
    assert shared > 0.05 * want
    for m in n4[0]:
        if m["dtype"] == "fp32":
            assert m["moe"]["grad_norms"][0] == pytest.approx(want, rel=1e-5), (m["stage"], m["moe"]["ep"])


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.slow
def test_estimate_equals_the_runs_to_the_byte(n4, tmp_path, ep):
    """``zerompi.estimate --experts 4 --shared-experts 2 --ep K``: the dense and expert parameters, the model
    states with and without the engines' padding, and each engine's ZeRO bytes, as the runs measured them (stage
    3: between the three passes less what the estimate keeps gathered at the turn at most, and the three)."""
    def comm(m, total, kept):
        run = m["comm_theory_bytes_per_step"]
        assert (run == total) if m["stage"] < 3 else (total - kept <= run <= total), (m["stage"], run, total, kept)

    for m in n4[0]:
        if m["moe"]["ep"] != ep or m["dtype"] != "fp16":
            continue
        est = cli_json(tmp_path, GPT + MOE_OPTS + ["--shared-experts", S, "--ep", ep, "--dtype", "fp16",
                                                   "--bucket-mb", 0.004])
        moe, row = est["moe"], est["moe"]["stages"][m["stage"]]
        assert moe["shared_experts"] == S and moe["dense_params"] + moe["expert_params"] == m["params"]
        if ep == 1:                 # one engine: the table is the whole model's
            assert (est["params"], est["padded_params"]) == (m["params"], m["padded_params"])
            assert est["stages"][m["stage"]]["model_state_bytes"] == m["memory_bytes"]["total"]
            st = est["stages"][m["stage"]]
            comm(m, st["comm_bytes_per_step"], st["comm_bytes_kept_at_turns"])
            continue
        mem = m["moe"]["memory_bytes_by_engine"]
        assert (row["dense_bytes"], row["expert_bytes"]) == (mem["dense"]["theory"], mem["experts"]["theory"])
        assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                           mem["experts"]["measured"])
        comm(m, row["dense_comm_bytes_per_step"] + row["expert_comm_bytes_per_step"],
             est["stages"][m["stage"]]["comm_bytes_kept_at_turns"] + row["expert_comm_bytes_kept_at_turns"])


def test_checkpoint_resumed_at_another_ep(tmp_path):
    """Saved at --ep 2 stage 3 after 2 steps; resumed at --ep 4 stage 1 and --ep 1 stage 2: the bits of the run
    that never stopped (the shared experts are the dense checkpoint's parameters)."""
    i = SHARED.index("--steps")
    f = SHARED[:i] + SHARED[i + 2:] + ["--dtype", "fp32", "--steps"]
    at = lambda ep, stage: ["--ep", str(ep), "--stage", str(stage)]        # noqa: E731
    d, e1 = tmp_path / "ck", tmp_path / "e1"
    runs = run_many(4, [f + ["4"] + at(2, 3), f + ["2"] + at(2, 3) + ["--save-dir", str(d)],
                        f + ["4"] + at(4, 1) + ["--resume", str(d)], f + ["4"] + at(1, 2) + ["--resume", str(d)],
                        f + ["2"] + at(1, 0) + ["--save-dir", str(e1)]])
    assert len(runs) == 5
    full = runs[0]
    for resumed in runs[2:4]:
        assert resumed["first_step"] == 2 and resumed["losses"] == full["losses"][2:]
        assert resumed["final_params_sha256"] == full["final_params_sha256"]
    # consolidated, the --ep 2 save is the --ep 1 run's checkpoint: names, order, values; hashed, its digest
    for path in (d, e1):
        proc = subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "consolidate", str(path),
                               str(path) + ".npz"], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr
    a, b = np.load(str(d) + ".npz"), np.load(str(e1) + ".npz")
    assert a.files == b.files and "block1.shared.out.w" in a.files
    assert all(np.array_equal(a[n], b[n]) for n in b.files)
    masters = [n for n in a.files if "/" not in n]
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a[n], "<f4").tobytes() for n in masters)).hexdigest()
    assert digest == runs[1]["final_params_sha256"] == runs[4]["final_params_sha256"]


@pytest.mark.parametrize("k", [2, 4])
def test_tp_model_equals_the_full_model(k):
    """tests/drivers/moe_tp_model.py with 2 shared experts: the TP MoE GPT against the unsplit one (float64 1e-12,
    float32 1e-5), the shared experts' gradients replicated bit for bit on every TP rank."""
    out = run_mpi(k, ["tests/drivers/moe_tp_model.py", str(S)], timeout=120).stdout
    res = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-5)):
        r = res[dtype]
        assert r["names"] and r["replicated_identical"] and r["experts_replicated"] == 10 + 2 * 4, r
        assert r["loss"] <= tol and r["grad"] <= tol, r
        assert r["same_tokens_as_full"] and r["checkpoint_same_bits"], r


def test_tp_stages_ep_and_against_tp1():
    """N=4 tp 2: stages 0 and 3, --ep 1 and 2 bit-identical; against N=2 tp 1 the losses within 1e-5 and the same
    routing; the gradient norm the float64 single-process value."""
    tp = run_many(4, [SHARED + ["--dtype", "fp32", "--stage", str(s), "--tp", "2", "--ep", str(e)]
                      for s in (0, 3) for e in (1, 2)])
    one = run_many(2, [SHARED + ["--dtype", "fp32", "--stage", "1"]])
    assert len(tp) == 4 and len(one) == 1
    want = float(np.sqrt(sum((v * v).sum() for v in float64_mean_grads(2, shared=S).values())))
    for m in tp:
        same_run(m, tp[0])
        assert m["params"] == one[0]["params"]
        np.testing.assert_allclose(m["losses"], one[0]["losses"], rtol=1e-5)
        for key in ("tokens_min", "tokens_max", "dropped"):
            assert m["moe"][key] == one[0]["moe"][key], key
        assert m["moe"]["grad_norms"][0] == pytest.approx(want, rel=1e-5)


def test_pipelined_equals_unpipelined():
    flags = SHARED + ["--dtype", "fp32", "--stage", "1", "--micro-batches", "2"]
    piped, plain = run_many(4, [flags + ["--pp", "2"]]), run_many(2, [flags])
    assert len(piped) == len(plain) == 1 and piped[0]["pipeline"] is not None
    for key in ("final_params_sha256", "losses", "val_losses", "params"):
        assert piped[0][key] == plain[0][key], key
    for key in ("tokens_min", "tokens_max", "dropped"):
        assert piped[0]["moe"][key] == plain[0]["moe"][key], key
    # the aux loss's report is summed over the mesh in another order (tests/test_moe_pipeline.py): to 1e-12
    assert piped[0]["moe"]["aux_loss"] == pytest.approx(plain[0]["moe"]["aux_loss"], rel=1e-12)
