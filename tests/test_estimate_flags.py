"""The estimate's --experts/--ep, --replicas and --optimizer against real runs: the CLI's numbers for the job a
train run describes equal what the run measured (its metrics' ``moe``, ``replicas`` and ``memory_bytes``), byte
for byte where the run's formula is exact; and each flag's bad values and refused combinations are one line,
exit status 2."""
import json
import os

import pytest

from tests.mpirun import run_mpi
from tests.test_moe_ep import FLAGS as MOE, metrics_of, run_many
from zerompi.estimate import cli

GPT = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "12", "--vocab", "32",
       "--ranks", "4"]                         # tests/test_moe_ep.py's GPT (the generated corpus: 32 tokens)
MOE_OPTS = ["--experts", "4", "--top-k", "2", "--expert-hidden", "24"]
WIDTH, DEPTH, BUCKET_MB = 20, 3, 0.002         # tests/test_estimate.py's MLP
MLP = ["--model", "mlp", "--width", str(WIDTH), "--depth", str(DEPTH), "--bucket-mb", str(BUCKET_MB), "--steps", "2",
       "--batch", "24", "--node-size", "2"]


def cli_json(tmp_path, argv, name="est.json"):
    path = tmp_path / name
    assert cli.main([*map(str, argv), "--json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def runs():
    """N = 4: the MoE GPT at --ep 2 (stages 1 and 3, fp16), the MLP with --replicas in 2 nodes of 2 (AdamW at
    stage 1, Muon at stage 3, fp16), the MoE GPT at --ep 1 (stages 0 and 3, fp16)."""
    job = f"est-flags-{os.getpid()}"
    configs = [MOE + ["--dtype", "fp16", "--stage", str(s), "--ep", "2"] for s in (1, 3)]
    configs += [MLP + ["--dtype", "fp16", "--stage", str(s), "--optimizer", opt, "--replicas", f"{job}-{opt}"]
                for s, opt in ((1, "adamw"), (3, "muon"))]
    configs += [MOE + ["--dtype", "fp16", "--stage", str(s), "--ep", "1"] for s in (0, 3)]
    out = run_many(4, configs, timeout=400)
    assert len(out) == 6
    return out


@pytest.mark.parametrize("which", [0, 1])
def test_moe_states_equal_the_runs(runs, tmp_path, which):
    """Dense states over the 4 ranks, expert states (2 of the 4 experts) over the 2 expert-data-parallel ranks:
    the CLI's rows equal what the run's two engines hold."""
    m = runs[which]
    est = cli_json(tmp_path, GPT + MOE_OPTS + ["--ep", 2, "--dtype", "fp16", "--bucket-mb", 0.004])
    row, mem = est["moe"]["stages"][m["stage"]], m["moe"]["memory_bytes_by_engine"]
    assert est["moe"]["dense_params"] + est["moe"]["expert_params"] == m["params"]
    assert (est["moe"]["dense_params"], est["moe"]["expert_params"] // 2) == (mem["dense"]["params"],
                                                                            mem["experts"]["params"])
    assert (row["dense_bytes"], row["expert_bytes"]) == (mem["dense"]["theory"], mem["experts"]["theory"])
    assert row["model_state_bytes"] == mem["dense"]["theory"] + mem["experts"]["theory"]
    # with the engines' padding: what they hold (the dense engine's is the table above)
    assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                       mem["experts"]["measured"])
    assert est["params"] == mem["dense"]["params"] and est["stages"][m["stage"]]["model_state_bytes"] == \
        mem["dense"]["measured"]


@pytest.mark.parametrize("which", [4, 5])
def test_moe_at_ep_1_the_table_is_the_one_engine(runs, tmp_path, which):
    """--ep 1: one engine holds the whole MoE GPT; the table's model states are its bytes."""
    m = runs[which]
    est = cli_json(tmp_path, GPT + MOE_OPTS + ["--dtype", "fp16", "--bucket-mb", 0.004])
    assert (est["params"], est["padded_params"]) == (m["params"], m["padded_params"])
    assert est["stages"][m["stage"]]["model_state_bytes"] == m["memory_bytes"]["total"]
    assert est["moe"]["all_to_all_bytes_per_step"] == m["moe"]["all_to_all_theory_bytes"] == 0


def test_moe_all_to_all_equals_a_balanced_run(tmp_path):
    """Exactly balanced routing (token i to expert i mod E, top-1), 3 micro-batches: every step sends the CLI's
    bytes, and the run's formula is the same."""
    flags = MOE + ["--dtype", "fp32", "--stage", "3", "--ep", "2", "--top-k", "1", "--micro-batches", "3"]
    moe = metrics_of(run_mpi(4, ["tests/drivers/moe_routing.py", "cycle", json.dumps(flags)], timeout=180))[0]["moe"]
    est = cli_json(tmp_path, GPT + ["--experts", 4, "--expert-hidden", 24, "--ep", 2, "--top-k", 1,
                                    "--micro-batches", 3, "--dtype", "fp32"])
    want = est["moe"]["all_to_all_bytes_per_step"]
    assert want == moe["all_to_all_theory_bytes"] == 2 * 3 * (16 + 4 * 4 * 16 * 4)
    assert moe["all_to_all_bytes"] == [want] * 3


ZERO_CONFIGS = [["--stage", "3", "--shard-size", "2"],                       # the dense GPT
                ["--stage", "1", *MOE_OPTS, "--ep", "2"],
                ["--stage", "3", *MOE_OPTS, "--ep", "2", "--shard-size", "2"],
                ["--stage", "3", *MOE_OPTS, "--ep", "1", "--shard-size", "2", "--hpz"]]


def test_the_gpts_zero_bytes_equal_the_runs(tmp_path):
    """N = 4 in nodes of 2 (ZEROMPI_NODE_SIZE: --ep refuses --node-size), buckets of 0.004 MiB (several per
    engine, some kept at stage 3's turns): for the GPT's dimensions the CLI's ZeRO bytes per step are the run's, by
    level and (the MoE table's dense and expert engines together) in total, the all-reduce across shard groups
    included. Measured before the estimate laid out the GPT's own layers: stage 3 640 bytes short (an equal-layers
    plan keeps other buckets at the turns), and the MoE rows without the all-reduce across groups (6,272 against
    15,936 at stage 1)."""
    base = MOE[:MOE.index("--experts")] + ["--dtype", "fp16", "--steps", "2", "--eval-every", "0"]
    configs = [base + c for c in ZERO_CONFIGS]
    runs = metrics_of(run_mpi(4, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=400,
                              env={"ZEROMPI_NODE_SIZE": "2"}))
    assert len(runs) == len(ZERO_CONFIGS)
    for flags, m in zip(ZERO_CONFIGS, runs):
        stage = int(flags[1])
        est = cli_json(tmp_path, GPT + flags[2:] + ["--dtype", "fp16", "--bucket-mb", 0.004, "--node-size", 2])
        row = est["stages"][stage]
        if "--ep" in flags and flags[flags.index("--ep") + 1] != "1":
            moe = est["moe"]["stages"][stage]
            assert moe["dense_comm_bytes_per_step"] + moe["expert_comm_bytes_per_step"] == m["comm_bytes_per_step"], \
                (flags, moe)
        else:
            assert row["comm_bytes_per_step_by_level"] == m["comm_bytes_per_step_by_level"], flags
            assert sum(row["comm_bytes_per_step_by_level"].values()) == m["comm_bytes_per_step"], flags
            assert row["model_state_bytes"] == m["memory_bytes"]["total"], flags
        assert m["comm_bytes_per_step_by_level"]["inter"] > 0, flags


def test_pp_moe_all_to_all_equals_a_balanced_run(tmp_path):
    """--pp 2 --ep 2, interleaved with --moe-every 2 (stage 0's chunks hold no MoE block, stage 1's both), exactly
    balanced routing (top-1), 2 micro-batches: the CLI's all-to-all of each pipeline stage (0 bytes, and both
    blocks' formula) has the run's per-rank mean (the run counts every rank's bytes over all ranks), every step,
    and the run's own formula is that mean."""
    flags = MOE + ["--n-layer", "4", "--moe-every", "2", "--dtype", "fp32", "--stage", "2", "--ep", "2", "--top-k",
                   "1", "--micro-batches", "2", "--pp", "2", "--schedule", "interleaved", "--chunks", "2"]
    moe = metrics_of(run_mpi(4, ["tests/drivers/moe_routing.py", "cycle", json.dumps(flags)], timeout=180))[0]["moe"]
    est = cli_json(tmp_path, GPT + ["--n-layer", 4, "--moe-every", 2, "--experts", 4, "--expert-hidden", 24,
                                    "--ep", 2, "--top-k", 1, "--micro-batches", 2, "--dtype", "fp32", "--pp", 2,
                                    "--schedule", "interleaved", "--chunks", 2])
    stages = est["moe"]["pipeline_stages"]
    assert [st["moe_blocks"] for st in stages] == [0, 2] and stages[0]["all_to_all_bytes_per_step"] == 0
    # 2 blocks x 2 micro-batches x ((2-1)·2·8 + 4 x 24·1·(1/2) x 16 x 4 B), 24 tokens of a rank's micro-batch
    assert stages[1]["all_to_all_bytes_per_step"] == 2 * 2 * (16 + 4 * 12 * 16 * 4)
    mean = sum(st["all_to_all_bytes_per_step"] for st in stages) / 2
    assert moe["all_to_all_bytes"] == [mean] * 3 and moe["all_to_all_theory_bytes"] == mean


@pytest.mark.parametrize("which", [2, 3])
def test_replicas_and_optimizer_equal_the_runs(runs, tmp_path, which):
    """--replicas: the formula's bytes equal the run's (its padded shard, its optimizer's rows) exactly, and the
    shared memory the run's folder held is that plus the step's manifest; --optimizer: the model states (Muon's
    16 bytes per parameter of state) equal what the engine holds."""
    m = runs[which]
    opt = m["config"]["zero"].get("optimizer", "adamw")
    est = cli_json(tmp_path, ["--params", m["params"], "--ranks", 4, "--layers", DEPTH, "--bucket-mb", BUCKET_MB,
                              "--node-size", 2, "--replicas", "--optimizer", opt])
    rep, ran = est["replicas"], m["replicas"]
    assert rep["rows"] == (4 if opt == "muon" else 3)
    assert rep["total"] == ran["theory_bytes"]["total"] and rep["per_step"] == ran["theory_bytes"]["per_step"]
    assert rep["total"] == ran["shard_bytes"] < ran["shm_bytes"] < rep["total"] + 64 * 1024   # + the manifests
    row, mem = est["stages"][m["stage"]], m["memory_bytes"]
    assert (row["optimizer_bytes"], row["model_state_bytes"]) == (mem["optimizer"], mem["total"])
    assert est["optimizer"] == opt


REPLICA_MESHES = [(["--stage", "3", "--tp", "2", "--node-size", "2"], 2),
                  (["--stage", "1", "--sp", "2", "--node-size", "2"], 2),
                  (["--stage", "3", *MOE_OPTS, "--ep", "2"], 4),         # nodes: $ZEROMPI_NODE_SIZE (--ep)
                  (["--stage", "1", "--tp", "2", *MOE_OPTS, "--ep", "2"], 4),   # a TP rank's dense share, experts
                  (["--stage", "2", *MOE_OPTS, "--ep", "1", "--node-size", "2"], 2),
                  (["--stage", "3", "--node-size", "2", "--shard-size", "2"], 1),   # whole nodes: mirrored
                  (["--stage", "3", "--node-size", "1", "--shard-size", "2"], 2)]


def test_replicas_with_tp_sp_ep_and_shard_groups_equal_the_runs_shard_files(tmp_path):
    """--replicas at N = 4 with --tp 2, --sp 2, --experts 4 --ep 2 (two engines: the dense shard and this EP
    rank's experts'; with --tp 2 too), --ep 1, and shard groups of whole nodes (the buddy holds the same shard: one
    file) or not: the CLI's bytes equal the shard files the run's folder held, to the byte, and the run's own
    formula; the rest of its shared memory is the manifests."""
    job = f"est-rep-{os.getpid()}"
    base = MOE[:MOE.index("--experts")] + ["--steps", "2", "--eval-every", "0", "--dtype", "fp16"]
    configs = [base + flags + ["--replicas", f"{job}-{i}"] for i, (flags, _) in enumerate(REPLICA_MESHES)]
    runs = metrics_of(run_mpi(4, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=400,
                              env={"ZEROMPI_NODE_SIZE": "2"}))      # --node-size, where given, is the nodes
    for (flags, files), m in zip(REPLICA_MESHES, runs):
        est = cli_json(tmp_path, GPT + ["--bucket-mb", 0.004, "--dtype", "fp16", "--replicas", *flags[2:]])
        rep, ran = est["replicas"], m["replicas"]
        assert rep["files"] == ran["theory_bytes"]["files"] == files, flags
        assert rep["total"] == ran["shard_bytes"] == ran["theory_bytes"]["total"], (flags, rep, ran)
        assert ran["shard_bytes"] < ran["shm_bytes"] < ran["shard_bytes"] + 64 * 1024, flags


PP_MESHES = [["--stage", "1", "--node-size", "2"],                  # a stage per node: every rank the same
             ["--stage", "3", "--node-size", "1"],                  # buddies across stages: the ranks differ
             ["--stage", "2", "--node-size", "1", "--schedule", "interleaved", "--chunks", "2"]]


def test_replicas_with_pp_equal_every_ranks_shard_files(tmp_path):
    """--pp 2 --replicas at N = 4 (the GPT of 4 blocks, and the MLP of 4 equal layers from --params --layers):
    each chunk's engine a part, a rank's own chunks and its source's; the CLI's bytes of every rank equal the shard
    files that rank's folder held and its own formula, to the byte, and the rank it names holds the most (with
    nodes of one rank, rank 1 holds stage 0's shard twice: its own and rank 0's)."""
    job = f"est-pp-{os.getpid()}"
    gpt = MOE[:MOE.index("--experts")] + ["--n-layer", "4"]
    mlp = MLP[:MLP.index("--depth")] + ["--depth", "4"] + MLP[MLP.index("--depth") + 2:MLP.index("--node-size")]
    base = ["--steps", "2", "--dtype", "fp16", "--pp", "2", "--micro-batches", "2"]
    configs = [gpt + ["--eval-every", "0"] + base + flags + ["--replicas", f"{job}-{i}"]
               for i, flags in enumerate(PP_MESHES)]
    configs.append(mlp + base + PP_MESHES[1] + ["--replicas", f"{job}-mlp"])
    runs = metrics_of(run_mpi(4, ["tests/drivers/metrics_by_rank.py", json.dumps(configs)], timeout=400))
    assert len(runs) == 4
    dims = GPT[:GPT.index("--n-layer") + 1] + ["4"] + GPT[GPT.index("--n-layer") + 2:]
    for i, (flags, m) in enumerate(zip(PP_MESHES + [PP_MESHES[1]], runs)):
        model = dims + ["--bucket-mb", 0.004] if i < 3 else \
            ["--params", m["params"], "--layers", 4, "--ranks", 4, "--bucket-mb", BUCKET_MB]
        est = cli_json(tmp_path, model + ["--dtype", "fp16", "--pp", 2, "--micro-batches", 2, "--replicas",
                                          *flags[2:]])
        rep, ran = est["replicas"], [r["replicas"] for r in m["by_rank"]]
        assert rep["by_rank"] == [r["shard_bytes"] for r in ran] == [r["theory_bytes"]["total"] for r in ran], \
            (flags, rep, ran)
        assert all(r["shard_bytes"] < r["shm_bytes"] < r["shard_bytes"] + 64 * 1024 for r in ran), flags
        assert rep["total"] == max(rep["by_rank"]) == ran[rep["rank"]]["shard_bytes"]
        assert rep["files"] == ran[rep["rank"]]["theory_bytes"]["files"] == 2 * (1 + ("--chunks" in flags))
        if flags[3] == "1" and i < 3:         # the ranks differ: stage 0 (the embeddings) is the larger shard
            assert rep["rank"] == 1 and len(set(rep["by_rank"])) == 3, rep
    assert len(set(r["replicas"]["shard_bytes"] for r in runs[3]["by_rank"])) == 1   # equal layers


PP_EP = [["--stage", "1"], ["--stage", "3"],
         ["--stage", "2", "--n-layer", "4", "--schedule", "interleaved", "--chunks", "2", "--moe-every", "2"]]


def test_pp_with_ep_states_equal_every_ranks_engines(tmp_path):
    """--pp 2 --experts 4 --ep 2 at N = 4: each stage's dense engines (its chunks' layers without the experts, over
    its 2 ranks) and expert engines (2 experts of each MoE block, over 1 rank); the CLI's rows of a rank's pipeline
    stage equal what its engines hold (the formulas and the padded layouts) and what its collectives sent in a step
    (the ZeRO bytes), on every rank, and the stage it names the largest holds the most. Interleaved with
    --moe-every 2: stage 0's chunks hold no MoE block (no expert engine), stage 1's both."""
    base = MOE + ["--steps", "2", "--dtype", "fp16", "--pp", "2", "--micro-batches", "2", "--ep", "2"]
    configs = [base + f for f in PP_EP] + [base + ["--stage", "1", "--ep", "1"]]
    runs = metrics_of(run_mpi(4, ["tests/drivers/metrics_by_rank.py", json.dumps(configs)], timeout=400))
    assert len(runs) == 4
    for flags, m in zip(PP_EP, runs):
        dims = GPT + (["--n-layer", "4"] if "--n-layer" in flags else [])
        est = cli_json(tmp_path, dims + MOE_OPTS + ["--ep", 2, "--dtype", "fp16", "--bucket-mb", 0.004, "--pp", 2,
                                                    "--micro-batches", 2, *flags[2:]])
        pm, z = est["moe"], m["stage"]
        held = []
        for rank, r in enumerate(m["by_rank"]):
            st, mem = pm["pipeline_stages"][rank // 2], r["moe"]["memory_bytes_by_engine"]
            row = st["zero_stages"][z]
            assert (row["dense_bytes"], row["expert_bytes"]) == (mem["dense"]["theory"], mem["experts"]["theory"])
            assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                               mem["experts"]["measured"]), flags
            assert (st["dense_params"], st["expert_params"]) == (mem["dense"]["params"], mem["experts"]["params"])
            held.append(mem["dense"]["measured"] + mem["experts"]["measured"])
            # the stage's engines' ZeRO bytes: this rank's collectives of a steady step (stage 3: each chunk's one
            # bucket kept gathered from its forward to its backward, as the estimate keeps it)
            sent = sum(r["comm_bytes_per_step_by_op"].values())
            assert sent == row["comm_bytes_per_step"] - (row["comm_bytes_kept_at_turns"] if z == 3 else 0), \
                (flags, rank, sent, row)
        assert held[2 * pm["largest_stage"][z]] == max(held), (flags, held)
        assert sum(s["dense_params"] + 2 * s["expert_params"] for s in pm["pipeline_stages"]) == m["params"]
    assert runs[2]["by_rank"][0]["moe"]["memory_bytes_by_engine"]["experts"]["params"] == 0   # no MoE block
    # --ep 1: one engine per chunk, the experts in its blocks; rank 0 (stage 0) holds the table's bytes
    est = cli_json(tmp_path, GPT + MOE_OPTS + ["--dtype", "fp16", "--bucket-mb", 0.004, "--pp", 2,
                                               "--micro-batches", 2])
    row = est["moe"]["pipeline_stages"][0]["zero_stages"][1]
    assert row["padded_bytes"] == row["dense_padded_bytes"] == runs[3]["memory_bytes"]["total"] and \
        row["expert_bytes"] == 0
    for rank, r in enumerate(runs[3]["by_rank"]):
        row = est["moe"]["pipeline_stages"][rank // 2]["zero_stages"][1]
        assert sum(r["comm_bytes_per_step_by_op"].values()) == row["comm_bytes_per_step"] > 0, (rank, row)


@pytest.mark.slow
def test_pp_tp_ep_equal_every_ranks_engines(tmp_path):
    """N = 8 --pp 2 --tp 2 --ep 2, stages 0-3: a stage's dense engine holds a TP rank's share of its chunk (the
    attention split, the router and experts whole) over its 2 data-parallel ranks, its expert engine 2 experts of
    its block whole over 1 rank; the CLI's rows of each rank's pipeline stage equal what its engines hold (formulas,
    padded layouts, parameters) and what its collectives sent in a step, and the TP all-reduce bytes the run's; with
    --replicas in nodes of 4, every rank's shard files."""
    base = MOE + ["--steps", "2", "--dtype", "fp16", "--pp", "2", "--micro-batches", "2", "--ep", "2", "--tp", "2"]
    runs = metrics_of(run_mpi(8, ["tests/drivers/metrics_by_rank.py",
                                  json.dumps([base + ["--stage", str(z)] for z in range(4)])], timeout=600))
    assert len(runs) == 4
    dims = GPT[:GPT.index("--ranks")] + ["--ranks", 8]
    est = cli_json(tmp_path, dims + MOE_OPTS + ["--ep", 2, "--tp", 2, "--dtype", "fp16", "--bucket-mb", 0.004,
                                                "--pp", 2, "--micro-batches", 2])
    pm = est["moe"]
    assert pm["tp"] == 2 and [st["ranks"] for st in pm["pipeline_stages"]] == [2, 2]
    for z, m in enumerate(runs):
        assert m["stage"] == z
        for rank, r in enumerate(m["by_rank"]):
            st, mem = pm["pipeline_stages"][rank // 4], r["moe"]["memory_bytes_by_engine"]
            row = st["zero_stages"][z]
            assert (st["dense_params"], st["expert_params"]) == (mem["dense"]["params"], mem["experts"]["params"])
            assert (row["dense_bytes"], row["expert_bytes"]) == (mem["dense"]["theory"], mem["experts"]["theory"])
            assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                               mem["experts"]["measured"]), rank
            sent = sum(r["comm_bytes_per_step_by_op"].values())
            assert sent == row["comm_bytes_per_step"] - (row["comm_bytes_kept_at_turns"] if z == 3 else 0), \
                (z, rank, sent, row)
        assert max(st["tp_bytes_per_step"] for st in pm["pipeline_stages"]) == m["tensor_parallel"]["bytes_per_step"]
    # --replicas in nodes of 4 (a stage per node): every rank's shard files, its engines' and its source's
    job = f"est-pptp-{os.getpid()}"
    m = metrics_of(run_mpi(8, ["tests/drivers/metrics_by_rank.py", json.dumps([base + ["--stage", "1", "--eval-every",
                                                                                      "0", "--replicas", job]])],
                           timeout=600, env={"ZEROMPI_NODE_SIZE": "4"}))[0]
    rep = cli_json(tmp_path, dims + MOE_OPTS + ["--ep", 2, "--tp", 2, "--dtype", "fp16", "--bucket-mb", 0.004,
                                                "--pp", 2, "--micro-batches", 2, "--replicas", "--node-size", 4])
    ran = [r["replicas"] for r in m["by_rank"]]
    assert rep["replicas"]["by_rank"] == [r["shard_bytes"] for r in ran] == [r["theory_bytes"]["total"] for r in ran]
    assert rep["replicas"]["files"] == 4       # a stage per node: each rank its 2 engines and the other stage's 2


def test_pp_with_ep_replicas_equal_every_ranks_shard_files(tmp_path):
    """--pp 2 --experts 4 --ep 2 --replicas at N = 4 in nodes of 2 (a stage per node): a rank's parts are its chunks'
    dense engines and expert engines (train/moe/checkpoints.py), its own and its source's; the CLI's bytes of every
    rank equal the shard files that rank's folder held and its own formula, to the byte. Interleaved with
    --moe-every 2: stage 0's chunks hold no expert engine (2 dense files), stage 1's two of each."""
    job = f"est-ppep-{os.getpid()}"
    base = MOE + ["--steps", "2", "--dtype", "fp16", "--pp", "2", "--micro-batches", "2", "--ep", "2",
                  "--eval-every", "0"]
    configs = [base + f + ["--replicas", f"{job}-{i}"] for i, f in enumerate(PP_EP)]
    runs = metrics_of(run_mpi(4, ["tests/drivers/metrics_by_rank.py", json.dumps(configs)], timeout=400,
                              env={"ZEROMPI_NODE_SIZE": "2"}))
    assert len(runs) == 3
    for flags, m in zip(PP_EP, runs):
        dims = GPT + (["--n-layer", "4"] if "--n-layer" in flags else [])
        est = cli_json(tmp_path, dims + MOE_OPTS + ["--ep", 2, "--dtype", "fp16", "--bucket-mb", 0.004, "--pp", 2,
                                                    "--micro-batches", 2, "--replicas", "--node-size", 2,
                                                    *flags[2:]])
        rep, ran = est["replicas"], [r["replicas"] for r in m["by_rank"]]
        assert rep["by_rank"] == [r["shard_bytes"] for r in ran] == [r["theory_bytes"]["total"] for r in ran], \
            (flags, rep, ran)
        assert all(r["shard_bytes"] < r["shm_bytes"] < r["shard_bytes"] + 64 * 1024 for r in ran), flags
        assert rep["total"] == max(rep["by_rank"]) == ran[rep["rank"]]["shard_bytes"]
        parts = ran[0]["parts"]
        assert parts == (["pp0-of-2", "pp0-of-2/ep0-of-2"] if "--chunks" not in flags else ["pp0-of-4", "pp2-of-4"])
    assert runs[2]["by_rank"][2]["replicas"]["parts"] == ["pp1-of-4", "pp1-of-4/ep0-of-2", "pp3-of-4",
                                                          "pp3-of-4/ep0-of-2"]


BAD = [
    (GPT + ["--experts", "0"], "experts=0 must be an integer >= 1"),
    (GPT + ["--experts", "4", "--ep", "3"], "experts=4 is not divisible by ep=3"),
    (GPT + ["--experts", "6", "--ep", "3"], "ep=3 does not divide the 4 ranks"),
    (GPT + ["--experts", "4", "--top-k", "5"], "top_k=5 is more than experts=4"),
    (GPT + ["--experts", "4", "--moe-every", "0"], "moe_every=0 must be an integer >= 1"),
    (GPT + ["--experts", "4", "--expert-hidden", "0"], "expert_hidden=0 must be an integer >= 1"),
    (GPT + ["--top-k", "1"], "top_k=1 (--top-k) applies with --experts only"),
    (GPT + ["--experts", "4", "--shared-experts", "-1"], "shared_experts=-1 must be an integer >= 0"),
    (GPT + ["--shared-experts", "1"], "shared_experts=1 (--shared-experts) applies with --experts only"),
    (GPT + ["--experts", "4", "--tp", "2", "--ep", "2", "--node-size", "2"],
     "--node-size (with --tp 2 --ep 2) with --experts 4 is not estimated yet (the run takes it"),
    (GPT + ["--experts", "4", "--tp", "4", "--ep", "2"], "ep=2 does not divide the 1 data-parallel ranks"),
    (GPT + ["--experts", "4", "--tp", "3"], "tp=3 does not divide the 4 ranks"),
    (GPT + ["--experts", "4", "--optimizer", "muon"], "--optimizer muon with --experts 4 is not estimated yet"),
    (GPT + ["--experts", "4", "--ep", "4", "--node-size", "2", "--shard-size", "2"],
     "--ep 4 with --shard-size 2: an EP group must fit in a shard group"),       # nodes: tests/test_moe_nodes.py
    (GPT + ["--experts", "4", "--ep", "2", "--quantize-grads", "int8"],
     "--quantize-grads with --ep 2 is not supported"),
    (GPT + ["--experts", "4", "--ep", "2", "--offload-optimizer", "cpu"],
     "--offload-optimizer with --experts 4 is not estimated yet (the run takes it"),
    (["--pp", "2", "--micro-batches", "2", "--experts", "4", "--ep", "2"], "--pp with --experts 4 needs the GPT's"),
    (GPT + ["--pp", "2", "--micro-batches", "2", "--experts", "4", "--ep", "2", "--replicas"],
     "--replicas keeps each shard's second copy on another node, and 4 ranks in nodes of 4 make 1 node"),
    (GPT + ["--pp", "2", "--micro-batches", "2", "--experts", "4", "--ep", "4"],
     "ep=4 does not divide the 2 data-parallel ranks of each pipeline stage"),
    (["--params", "1e6", "--ranks", "4", "--experts", "4"], "experts=4: give the GPT's dimensions"),
    (["--params", "1e6", "--ranks", "4", "--replicas"], "4 ranks in nodes of 4 make 1 node"),
    (GPT + ["--tp", "2", "--node-size", "2", "--shard-size", "2", "--replicas"],
     "the estimate does not price --replicas with --shard-size 2 with --tp 2 yet"),
    (GPT + ["--tp", "2", "--replicas"], "4 ranks in nodes of 4 make 1 node"),
    (["--pp", "2", "--micro-batches", "2", "--replicas"], "--pp with --replicas needs --ranks"),
    (["--pp", "2", "--micro-batches", "2", "--replicas", "--params", "1e6", "--ranks", "4"],
     "--pp with --replicas and --params needs --layers"),
    (["--pp", "2", "--micro-batches", "2", "--schedule", "interleaved", "--chunks", "2", "--replicas", "--params",
      "1e6", "--ranks", "4", "--layers", "6"], "layers=6 is not divisible into 4 equal chunks"),
    (["--pp", "2", "--micro-batches", "2", "--replicas", "--params", "1e6", "--ranks", "4", "--layers", "4"],
     "4 ranks in nodes of 4 make 1 node"),
    (GPT + ["--pp", "2", "--micro-batches", "2", "--replicas", "--params", "1e6", "--node-size", "2"],
     "give one of the two"),
    (GPT + ["--pp", "2", "--node-size", "2"], "drop --node-size --n-layer"),
    (GPT[2:] + ["--pp", "2", "--micro-batches", "2", "--replicas", "--node-size", "2"], "missing: --n-layer"),
    (GPT + ["--n-layer", "3", "--pp", "2", "--micro-batches", "2", "--replicas", "--node-size", "2"],
     "n_layer=3 is not divisible into 2"),
    (["--params", "1e6", "--ranks", "4", "--optimizer", "sgd"], "optimizer='sgd' is not allowed; use one of adamw"),
    (["--params", "1e6", "--ranks", "4", "--optimizer", "muon", "--offload-optimizer", "cpu"],
     "not available with --optimizer muon yet"),
    (["--from-run", "run.json", "--optimizer", "muon"], "--optimizer does not apply with --from-run"),
    (["--from-run", "run.json", "--replicas"], "--replicas does not apply with --from-run"),
]


@pytest.mark.parametrize("argv,needle", BAD)
def test_bad_values_and_combinations_are_one_line(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
