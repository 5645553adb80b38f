"""--tp with --experts: each MoE block's attention TP-split as the dense GPT's, its router and experts whole on
every TP rank. At a fixed mesh (N=4, tp 2, dp 2) stages 0-3 are bit-identical, --ep 1 and --ep 2 too (fp32 and
fp16); against --tp 1 at the same data-parallel size the losses agree within the TP tests' 1e-5 and the routing
counts are the same; the gradient norm counts every expert once (the float64 single-process value); the TP
bytes equal their formula (an MoE block: 2 all-reduces, its attention's); with --checkpoint-activations the same
bits; routing forced per data-parallel rank ends at every stage."""
import json

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.test_moe_ep import FLAGS, metrics_of, run_many, same_run
from tests.test_moe_parity import float64_mean_grads


@pytest.mark.parametrize("k", [2, 4])
def test_tp_moe_model_equals_the_full_model(k):
    """One forward and backward (tests/drivers/moe_tp_model.py; 4 blocks, 1 and 3 MoE) against the unsplit model
    in one process, the TP promise of tests/test_tensor_parallel.py: float64 within 1e-12 relative, float32 1e-5;
    the replicated gradients (router and experts too) bit-identical on every TP rank; the same routing; per
    micro-batch 4 all-reduces per dense block, 2 per MoE block (6 and 3 checkpointed, the same bits)."""
    out = run_mpi(k, ["tests/drivers/moe_tp_model.py"], timeout=120).stdout
    res = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    B, T, C = 3, 8, 16
    for dtype, tol, isz in (("float64", 1e-12, 8), ("float32", 1e-5, 4)):
        r = res[dtype]
        assert r["names"] and r["replicated_identical"] and r["experts_replicated"] == 10, r
        assert r["loss"] <= tol and r["grad"] <= tol, r
        assert r["same_tokens_as_full"] and r["checkpoint_same_bits"] and r["checkpoint_same_tokens"], r
        one = 2 * (k - 1) * (B * T * C // k) * isz
        assert r["calls"] == 2 * 4 + 2 * 2 and r["bytes"] == r["formula_bytes"] == 12 * one, r
        assert r["ckpt"]["calls"] == 2 * 6 + 2 * 3 and r["ckpt"]["bytes"] == r["ckpt"]["formula_bytes"] == 18 * one


@pytest.fixture(scope="module")
def n4():
    configs = [FLAGS + ["--dtype", dtype, "--stage", str(stage), "--tp", "2", "--ep", str(ep)]
               for dtype in ("fp32", "fp16") for stage in range(4) for ep in (1, 2)]
    runs = run_many(4, configs)
    assert len(runs) == 16
    return runs


@pytest.fixture(scope="module")
def dp2():
    """The same data-parallel size without TP: N=2, --tp 1."""
    runs = run_many(2, [FLAGS + ["--dtype", dtype, "--stage", "1"] for dtype in ("fp32", "fp16")])
    assert len(runs) == 2
    return {m["dtype"]: m for m in runs}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_stages_and_ep_sizes_bit_identical_under_tp(n4, dtype):
    runs = [m for m in n4 if m["dtype"] == dtype]
    assert {(m["stage"], m["moe"]["ep"]) for m in runs} == {(s, e) for s in range(4) for e in (1, 2)}
    for m in runs:
        assert m["tensor_parallel"]["tp"] == 2
        same_run(m, runs[0])
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_tp_matches_the_unsplit_run(n4, dp2, dtype):
    """The TP promise (tests/test_tensor_parallel.py): every loss within 1e-5 relative of the run without TP at
    the same data-parallel size; the same parameter count, and the routing counted once (not once per TP rank)."""
    ref = dp2[dtype]
    for m in (m for m in n4 if m["dtype"] == dtype):
        assert m["params"] == ref["params"]
        np.testing.assert_allclose(m["losses"], ref["losses"], rtol=1e-5)
        np.testing.assert_allclose([v for _, v in m["val_losses"]], [v for _, v in ref["val_losses"]], rtol=1e-5)
        for key in ("tokens_min", "tokens_mean", "tokens_max", "dropped"):
            assert m["moe"][key] == ref["moe"][key], key
        np.testing.assert_allclose(m["moe"]["aux_loss"], ref["moe"]["aux_loss"], rtol=1e-5)


def test_grad_norm_counts_every_expert_once_under_tp(n4):
    """The first step's gradient norm at tp 2 (ep 1 and 2) against the float64 norm of the averaged gradient of
    the two data-parallel shares: the experts, whole on both TP ranks, counted once."""
    total = float64_mean_grads(2)
    want = float(np.sqrt(sum((v * v).sum() for v in total.values())))
    experts = float(np.sqrt(sum((v * v).sum() for k, v in total.items() if ".experts." in k)))
    assert experts > 0.05 * want
    for m in n4:
        if m["dtype"] == "fp32":
            assert m["moe"]["grad_norms"][0] == pytest.approx(want, rel=1e-5), (m["stage"], m["moe"]["ep"])


def test_tp_and_zero_bytes_equal_their_formulas(n4):
    """An MoE block has 2 TP all-reduces per micro-batch (the projection's forward, the qkv's input gradient), each
    of rows·T·C values, 2(K-1)/K of them sent: 2 blocks x 2 x (6·8·16) x 4 B at K = 2; ZeRO's as its formula."""
    for m in n4:
        tp = m["tensor_parallel"]
        assert tp["theory_bytes_per_step"] == 2 * 2 * (6 * 8 * 16) * 4      # fp32 compute in fp16 runs too
        assert tp["bytes_per_step"] == tp["theory_bytes_per_step"]
        assert m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"], (m["stage"], m["moe"]["ep"])


def test_checkpointed_activations_same_bits():
    """--checkpoint-activations with --experts (the MoE block's forward, its routing included, run again in its
    backward; counted once; with --ep its exchanges run again): the same losses, sha256 and routing counts as
    without, with TP and EP (dense blocks between the MoE ones, capacity, micro-batches) and without."""
    flags = list(FLAGS)
    flags[flags.index("--n-layer") + 1] = "4"
    flags[flags.index("--batch") + 1] = "16"
    flags += ["--moe-every", "2", "--capacity-factor", "0.8", "--micro-batches", "2"]
    configs = [flags + ["--dtype", dtype, "--stage", str(stage), "--tp", str(tp), "--ep", str(ep)] + ckpt
               for dtype, stage in (("fp32", 1), ("fp16", 3)) for tp in (1, 2) for ep in (1, 2)
               for ckpt in ([], ["--checkpoint-activations"])]
    runs = run_many(4, configs)
    assert len(runs) == 16
    for i in range(0, 16, 2):
        plain, ckpt = runs[i], runs[i + 1]
        assert ckpt["flags"][-1] == "--checkpoint-activations" and plain["moe"]["moe_blocks"] == [1, 3]
        same_run(ckpt, plain)
        assert sum(plain["moe"]["dropped"]) > 0
        if plain["tensor_parallel"]:
            # 3 all-reduces per MoE block checkpointed (the forward's twice), 6 per dense block
            assert ckpt["tensor_parallel"]["bytes_per_step"] == ckpt["tensor_parallel"]["theory_bytes_per_step"]
            assert ckpt["tensor_parallel"]["bytes_per_step"] * 4 == plain["tensor_parallel"]["bytes_per_step"] * 6


@pytest.mark.parametrize("ep", [1, 2])
def test_routing_per_data_parallel_rank_ends_at_every_stage(ep):
    """Every token of data-parallel rank d to expert d (top-1, the two TP ranks of a group alike): each rank's
    experts get different tokens, and the run ends at every stage."""
    for stage in range(4):
        flags = FLAGS + ["--dtype", "fp32", "--stage", str(stage), "--tp", "2", "--ep", str(ep), "--top-k", "1"]
        runs = metrics_of(run_mpi(4, ["tests/drivers/moe_routing.py", "per-dp-rank", json.dumps(flags)],
                                  timeout=180))
        assert len(runs) == 1
        moe = runs[0]["moe"]
        # 2 data-parallel ranks x 6 sequences x 8 positions: experts 0 and 1 take 48 tokens each, 2 and 3 none
        assert (moe["tokens_min"][-1], moe["tokens_max"][-1]) == (0, 48)


def test_pipelined_tp_equals_unpipelined():
    """--pp 2 --tp 2 (ep 1; the MoE blocks TP-split inside the stages' chunks), also checkpointed, against --tp 2
    alone at the same data-parallel size: bit for bit."""
    flags = FLAGS + ["--dtype", "fp32", "--stage", "1", "--tp", "2", "--micro-batches", "2"]
    flags[flags.index("--batch") + 1] = "8"
    piped = run_many(4, [flags + ["--pp", "2"], flags + ["--pp", "2", "--checkpoint-activations"]])
    plain = run_many(2, [flags])
    assert len(piped) == 2 and len(plain) == 1
    for m in piped:
        same_run(m, plain[0])


@pytest.mark.parametrize("tp", ["1", "2"])
def test_checkpointed_all_to_all_bytes_equal_the_formula(tp):
    """Exactly balanced routing (token i to expert i mod E, top-1), --ep 2 --checkpoint-activations: the
    forward's exchanges run twice, so 2 x the counts and 6 passes of rows; every rank sends the formula's bytes."""
    flags = FLAGS + ["--dtype", "fp32", "--stage", "3", "--ep", "2", "--top-k", "1", "--micro-batches", "3",
                     "--checkpoint-activations", "--tp", tp]
    runs = metrics_of(run_mpi(4, ["tests/drivers/moe_routing.py", "cycle", json.dumps(flags)], timeout=180))
    moe = runs[0]["moe"]
    n = 12 // (4 // int(tp)) // 3 * 8                       # tokens of a data-parallel rank's micro-batch
    assert moe["tokens_min"] == moe["tokens_max"] == [24] * 3
    # 2 blocks x 3 micro-batches x (2 x (2-1)·2·8 + 6 x n·1·(1/2) x 16 x 4 B)
    assert moe["all_to_all_theory_bytes"] == 2 * 3 * (2 * 16 + 6 * (n // 2) * 16 * 4)
    assert moe["all_to_all_bytes"] == [moe["all_to_all_theory_bytes"]] * 3


@pytest.mark.parametrize("ep", [1, 2])
def test_estimate_equals_the_runs_to_the_byte(n4, tmp_path, ep):
    """``zerompi.estimate --experts 4 --tp 2 --ep K`` (fp16): the dense engine a TP rank's share (the attention
    split, router and experts whole) over the 2 data-parallel ranks, the expert engine 2 experts whole over 1 rank;
    the model states (formulas and padded layouts), each engine's ZeRO bytes (stage 3: between the three passes
    less what the estimate keeps gathered at the turn, and the three), the TP all-reduce bytes (2 per MoE block)
    and the all-to-all's formula equal what the runs measured, stages 0-3."""
    from tests.test_estimate_flags import GPT, MOE_OPTS, cli_json
    runs = [m for m in n4 if m["dtype"] == "fp16" and m["moe"]["ep"] == ep]
    assert sorted(m["stage"] for m in runs) == [0, 1, 2, 3]
    est = cli_json(tmp_path, GPT + MOE_OPTS + ["--tp", 2, "--ep", ep, "--dtype", "fp16", "--bucket-mb", 0.004])
    moe, tp = est["moe"], est["tensor_parallel"]
    for m in runs:
        z, run_tp = m["stage"], m["tensor_parallel"]
        assert moe["dense_params"] + moe["expert_params"] == m["params"] == tp["params_total"]
        # a TP rank's parameters: the table's engine, and at --ep 2 its 2 experts of each block (the second engine)
        assert tp["params_local"] + (moe["expert_params"] // ep if ep > 1 else 0) == run_tp["params_local"]
        assert tp["tp_bytes_per_step"] == run_tp["theory_bytes_per_step"] == run_tp["bytes_per_step"] == 12288
        assert moe["all_to_all_bytes_per_step"] == m["moe"]["all_to_all_theory_bytes"]
        st, run = est["stages"][z], m["comm_theory_bytes_per_step"]
        if ep == 1:                 # one engine: the table is the whole TP rank's
            assert (est["params"], est["padded_params"]) == (run_tp["params_local"], m["padded_params"])
            assert st["model_state_bytes"] == m["memory_bytes"]["total"]
            total, kept = st["comm_bytes_per_step"], st["comm_bytes_kept_at_turns"]
        else:
            mem, row = m["moe"]["memory_bytes_by_engine"], moe["stages"][z]
            assert (moe["dense_params_per_tp_rank"], moe["expert_params"] // ep) == (mem["dense"]["params"],
                                                                                     mem["experts"]["params"])
            assert (row["dense_bytes"], row["expert_bytes"]) == (mem["dense"]["theory"], mem["experts"]["theory"])
            assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                               mem["experts"]["measured"])
            assert row["dense_padded_bytes"] + row["expert_padded_bytes"] == m["memory_bytes"]["total"]
            total = row["dense_comm_bytes_per_step"] + row["expert_comm_bytes_per_step"]
            kept = st["comm_bytes_kept_at_turns"] + row["expert_comm_bytes_kept_at_turns"]
        assert (run == total) if z < 3 else (total - kept <= run <= total), (z, run, total, kept)
        assert m["comm_bytes_per_step"] == run
