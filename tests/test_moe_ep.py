"""Expert parallelism (--ep K): EP 1, 2, 4 bit-identical at every stage in fp32 and fp16 (final parameters, losses,
held-out losses, routing), dropless and with a capacity, with micro-batches; the gradient norm counts every
expert once (the single-process float64 value); and runs whose routing is forced to one expert, or differs per
rank, end at every stage (no rank skips a collective)."""
import json

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.test_moe_parity import float64_mean_grads
from zerompi.train.data import GeneratedData

FLAGS = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
         "--batch", "12", "--lr", "3e-3", "--bucket-mb", "0.004", "--log-every", "100",
         "--experts", "4", "--top-k", "2", "--expert-hidden", "24", "--steps", "3", "--eval-every", "3"]


def metrics_of(proc):
    return [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]


def run_many(n, configs, timeout=400):
    return metrics_of(run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=timeout))


def same_run(a, b):
    for key in ("final_params_sha256", "losses", "val_losses", "params"):
        assert a[key] == b[key], key
    for key in ("tokens_min", "tokens_mean", "tokens_max", "dropped", "aux_loss"):
        assert a["moe"][key] == b["moe"][key], key


@pytest.fixture(scope="module")
def n4():
    configs = [FLAGS + ["--dtype", dtype, "--stage", str(stage), "--ep", str(ep)]
               for dtype in ("fp32", "fp16") for stage in range(4) for ep in (1, 2, 4)]
    runs = run_many(4, configs)
    assert len(runs) == 24
    return runs


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_ep_sizes_and_stages_bit_identical(n4, dtype):
    runs = [m for m in n4 if m["dtype"] == dtype]
    assert sorted({m["moe"]["ep"] for m in runs}) == [1, 2, 4] and sorted({m["stage"] for m in runs}) == [0, 1, 2, 3]
    for m in runs:
        same_run(m, runs[0])
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]



def test_expert_traffic_in_the_run_table(n4):
    """The expert engine's collectives (over its expert-data-parallel group, K partials per reduce-scatter) are
    counted in the run's one traffic table, and equal its formula (engine/traffic.py, sources x reduce-scatter)."""
    for m in n4:
        assert m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"], (m["stage"], m["moe"]["ep"])


def test_grad_norm_counts_every_expert_once(n4):
    """The first step's gradient norm at EP 1, 2, 4 against the float64 norm of the same averaged gradient
    (every rank's share routed on its own); an expert counted twice or left out moves it by far more."""
    total = float64_mean_grads(4)
    want = float(np.sqrt(sum((v * v).sum() for v in total.values())))
    experts = float(np.sqrt(sum((v * v).sum() for k, v in total.items() if ".experts." in k)))
    assert experts > 0.05 * want          # the experts are a visible part of it
    for m in n4:
        if m["dtype"] == "fp32":
            assert m["moe"]["grad_norms"][0] == pytest.approx(want, rel=1e-5), m["moe"]["ep"]


def test_n2_capacity_and_micro_batches():
    configs = [FLAGS + ["--dtype", "fp32", "--stage", str(stage), "--ep", str(ep), "--capacity-factor", "0.8",
                        "--micro-batches", "2"] for stage in (0, 3) for ep in (1, 2)]
    runs = run_many(2, configs)
    assert len(runs) == 4 and all(d > 0 for d in runs[0]["moe"]["dropped"])
    for m in runs:
        same_run(m, runs[0])


def test_n2_selection_bias():
    """--bias-update (aux-loss-free balancing): the biases move with the step's global counts, the same at
    --ep 1 and 2, and the routing with them."""
    configs = [FLAGS + ["--dtype", "fp16", "--stage", str(stage), "--ep", str(ep), "--bias-update", bias]
               for stage in (1, 3) for ep in (1, 2) for bias in ("0", "0.003")]
    runs = run_many(2, configs)
    assert len(runs) == 8
    plain = [m for m in runs if m["moe"]["bias_update"] == 0]
    biased = [m for m in runs if m["moe"]["bias_update"] > 0]
    for group in (plain, biased):
        for m in group:
            same_run(m, group[0])
            assert m["moe"]["bias"] == group[0]["moe"]["bias"]
    assert any(v != 0 for b in biased[0]["moe"]["bias"].values() for v in b)
    assert plain[0]["moe"]["bias"] == {} and biased[0]["losses"] != plain[0]["losses"]


@pytest.mark.parametrize("mode", ["one", "per-rank"])
def test_forced_routing_ends_at_every_stage(mode):
    for stage in range(4):
        flags = FLAGS + ["--dtype", "fp32", "--stage", str(stage), "--ep", "2", "--top-k", "1"]
        runs = metrics_of(run_mpi(4, ["tests/drivers/moe_routing.py", mode, json.dumps(flags)], timeout=180))
        assert len(runs) == 1
        moe = runs[0]["moe"]
        # one: expert 0 takes all 96 tokens, the others none; per-rank: rank r's 24 tokens go to expert r
        assert (moe["tokens_min"][-1], moe["tokens_max"][-1]) == ((0, 96) if mode == "one" else (24, 24))


def test_all_to_all_bytes_equal_the_formula():
    """Exactly balanced routing (token i to expert i mod E, top-1): every rank sends the formula's bytes."""
    flags = FLAGS + ["--dtype", "fp32", "--stage", "3", "--ep", "2", "--top-k", "1", "--micro-batches", "3"]
    runs = metrics_of(run_mpi(4, ["tests/drivers/moe_routing.py", "cycle", json.dumps(flags)], timeout=180))
    moe = runs[0]["moe"]
    assert moe["tokens_min"] == moe["tokens_max"] == [24] * 3
    # 2 blocks x 3 micro-batches x ((2-1)·2·8 + 4 x 8·1·(1/2) x 16 x 4 B), 8 tokens per rank's micro-batch
    assert moe["all_to_all_theory_bytes"] == 2 * 3 * (16 + 4 * 4 * 16 * 4)
    assert moe["all_to_all_bytes"] == [moe["all_to_all_theory_bytes"]] * 3


def test_odd_world_n3_ep3():
    """N=3, 6 experts: --ep 3 (two experts per rank, every rank its own EP rank) equals --ep 1 at stages 1 and 3,
    fp32 and fp16."""
    flags = list(FLAGS)
    flags[flags.index("--experts") + 1] = "6"
    configs = [flags + ["--dtype", dtype, "--stage", str(stage), "--ep", str(ep)]
               for dtype in ("fp32", "fp16") for stage in (1, 3) for ep in (1, 3)]
    runs = run_many(3, configs)
    assert len(runs) == 8
    for dtype in ("fp32", "fp16"):
        mine = [m for m in runs if m["dtype"] == dtype]
        for m in mine:
            same_run(m, mine[0])


def test_estimate_gives_the_runs_model_states(n4):
    """zerompi.estimate.moe_bytes: the dense and expert parameters and model states each run reports (dense over
    N, experts over N/K), at every stage, dtype and EP size; the default job's size."""
    from zerompi.estimate.moe_bytes import gpt_moe_params, moe_states
    dense, experts = gpt_moe_params(GeneratedData(8, 0).vocab, 8, 16, 2, 4, 24)
    for m in n4:
        assert m["params"] == dense + experts
        mem, ep = m["moe"]["memory_bytes_by_engine"], m["moe"]["ep"]
        if ep == 1:
            assert mem is None
            continue
        want = moe_states(m["stage"], 4 if m["dtype"] == "fp32" else 2, 4, ep, dense, experts)
        assert (mem["dense"]["params"], mem["experts"]["params"]) == (dense, experts // ep)
        assert (mem["dense"]["ranks"], mem["experts"]["ranks"]) == (4, 4 // ep)
        assert mem["dense"]["theory"] == want["dense"]["total"] and mem["experts"]["theory"] == want["experts"]["total"]
    assert sum(gpt_moe_params(32, 64, 64, 2, 8, 256)) == 570496        # the done-when job (docs/moe.md)


def test_expert_reduce_scatter_starts_without_waiting():
    """The expert engine's reduce-scatter of the sources' partials is started, not run to the end, at its bucket's
    turn (rank r + 1 starts only after rank r's start returned: a blocking one hangs), and its sums are the
    blocking form's bit for bit (tests/drivers/sources_overlap.py)."""
    proc = run_mpi(3, ["tests/drivers/sources_overlap.py"], timeout=90)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"wrong": 0, "oracle_far": 0, "ranks": 3}


def test_overlapped_expert_reduce_scatter_keeps_the_bits():
    """The expert reduce-scatters in flight during the backward, waited before the step, give the bits of the
    blocking path (--no-overlap: each waited at once) and of --ep 1: stages 1 and 3, fp16, two micro-batches."""
    configs = [FLAGS + ["--dtype", "fp16", "--stage", str(stage), "--micro-batches", "2", "--batch", "16",
                        "--ep", str(ep), *extra]
               for stage in (1, 3) for ep, extra in ((1, []), (2, []), (2, ["--no-overlap"]), (4, []))]
    runs = run_many(4, configs)
    assert len(runs) == 8
    for m in runs:
        same_run(m, runs[0])
