"""Expert parallelism inside pipeline stages over nodes, shard groups, hpZ and offload: N=8 --pp 2 --ep 2 gives the
bits of the unpipelined N=4 --ep 2 run with each stage's node layout (nodes of 2 inside a stage: an EP group in a
node; nodes of 1: an EP group across nodes, its sources summed node by node), shard groups and hpZ, with --tp 2;
the node layout changes the bits (the two-level sums are not the flat ones), so each case can fail; offload to
host memory and to files keeps the bits of the run without it (the delayed update those of the unpipelined run
and of --ep 1 with it), each chunk's expert engine in a folder of its own
(two chunks per rank, interleaved), and leaves no file behind; the estimate gives each stage's model states in
these nodes, shard groups, hpZ and offload, to the byte (docs/moe.md)."""
import pytest

from tests.test_moe_pipeline_ep import EP, FLAGS, run_many, same_bits

BASE = FLAGS + EP + ["--batch", "16"]


def check_pipelined(configs, n=4):
    """Each config unpipelined at N=``n`` and with --pp 2 at 2N: the same bits; the ZeRO bytes their formula's."""
    flat = run_many(n, configs)
    piped = run_many(2 * n, [c + ["--pp", "2"] for c in configs], timeout=600)
    assert len(flat) == len(piped) == len(configs)
    for a, b in zip(flat, piped):
        same_bits(a, b)
        assert b["comm_bytes_per_step"] == b["comm_theory_bytes_per_step"], b["flags"]
    return flat, piped


@pytest.mark.slow
def test_nodes_shard_groups_and_hpz_equal_unpipelined():
    """Stages 1 and 3 in nodes of 2 (an EP group inside a node), nodes of 1 (an EP group across two nodes), shard
    groups of 2, hpZ, fp16, --sp 2 (the EP groups over a stage's DP x SP ranks, an SP group a node); the flat run
    (no nodes) differs from the run in nodes of 2."""
    nodes = [["--node-size", "2", "--stage", s] for s in ("1", "3")]
    nodes += [["--node-size", "1", "--stage", s] for s in ("1", "3")]
    nodes += [["--node-size", "2", "--stage", "3", "--hpz"], ["--node-size", "2", "--shard-size", "2", "--stage", "1"],
              ["--node-size", "2", "--stage", "2", "--dtype", "fp16"],
              ["--sp", "2", "--node-size", "2", "--stage", "3"]]
    configs = [BASE + (extra if "--dtype" in extra else extra + ["--dtype", "fp32"]) for extra in nodes]
    configs.append(BASE + ["--dtype", "fp32", "--stage", "1"])                  # no nodes: the flat reduce
    flat, piped = check_pipelined(configs)
    # in nodes of 2 each node's pair is summed first: other bits than the flat sum (nodes of 1 sum in rank order)
    assert flat[-1]["final_params_sha256"] != flat[0]["final_params_sha256"]
    for b in piped:
        assert b["moe"]["memory_bytes_by_engine"]["experts"]["ranks"] == 2


def test_nodes_of_two_stage_1():
    """The quick case: N=8 --pp 2 --ep 2 --node-size 2 at stage 1 against N=4 --ep 2 --node-size 2."""
    check_pipelined([BASE + ["--dtype", "fp32", "--stage", "1", "--node-size", "2"]])


@pytest.mark.slow
def test_nodes_with_tensor_parallelism():
    """N=8 --pp 2 --tp 2 --ep 2 in nodes of 2 (one TP group a node: each EP group across two nodes) and of 4 (a
    node a stage) against N=4 --tp 2 --ep 2 in the same nodes."""
    check_pipelined([FLAGS + EP + ["--tp", "2", "--node-size", ns, "--dtype", "fp32", "--stage", "3"]
                     for ns in ("2", "4")], n=4)


def test_offload_keeps_the_bits(tmp_path):
    """--pp 2 --ep 2, interleaved (two chunks per rank, each with an expert engine): the optimizer in host memory
    and in files, and stage 3's parameters in files, give the bits of the run without offload; the folders
    (DIR/pp{c}-of-{C}/experts beside the chunk's dense files) end empty; `zerompi.estimate` with the same offload
    gives pipeline stage 0's model states by place (device, host, disk) as rank 0's engines hold them."""
    off = tmp_path / "off"
    off.mkdir()
    flags = list(FLAGS)
    flags[flags.index("--n-layer") + 1] = "4"
    flags += EP + ["--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--dtype", "fp32"]
    nvme = ["--offload-dir", str(off)]
    configs = [flags + ["--stage", "2"], flags + ["--stage", "2", "--offload-optimizer", "cpu"],
               flags + ["--stage", "2", "--offload-optimizer", "nvme"] + nvme,
               flags + ["--stage", "3"], flags + ["--stage", "3", "--offload-optimizer", "nvme",
                                                  "--offload-params", "nvme"] + nvme]
    runs = run_many(4, configs)
    assert len(runs) == len(configs)
    for i, ref in ((1, 0), (2, 0), (4, 3)):
        for key in ("final_params_sha256", "losses", "val_losses"):
            assert runs[i][key] == runs[ref][key], (key, configs[i][len(flags):])
    assert [p.name for p in off.rglob("*")] == []
    # the estimate's rows of pipeline stage 0 (rank 0's), by place: the run's formula and what its engines hold
    from tests.test_estimate_flags import GPT, MOE_OPTS, cli_json
    dims = list(GPT)
    dims[dims.index("--n-layer") + 1] = "4"
    for m, f in zip(runs, configs):
        topo = f[len(flags) + 2:]
        topo = topo[:topo.index("--offload-dir")] if "--offload-dir" in topo else topo
        est = cli_json(tmp_path, dims + MOE_OPTS + ["--ep", 2, "--dtype", "fp32", "--bucket-mb", 0.004, "--pp", 2,
                                                    "--micro-batches", 2, "--schedule", "interleaved", "--chunks", 2]
                       + topo)
        row = est["moe"]["pipeline_stages"][0]["zero_stages"][m["stage"]]
        for place, want in row["padded_bytes_by_place"].items():
            held = {k: v for k, v in m["memory_bytes_by_place"][place].items() if k not in ("buffers", "total")}
            assert want == m["theory_bytes_by_place"][place]["total"] == sum(held.values()), (topo, place)
        assert row["padded_bytes_by_place"]["device"] < row["padded_bytes"] or not topo


def test_the_estimate_in_nodes_equals_every_ranks_engines(tmp_path):
    """`zerompi.estimate --pp 2 --experts 4 --ep 2` with --node-size, --shard-size and --hpz at N = 8: each pipeline
    stage's rows (the formulas over each engine's shard group with hpZ's copy, and the padded layouts) equal what
    every rank's dense and expert engines hold, its ZeRO bytes per step (in nodes, with hpZ) what every rank's
    collectives sent; hpZ (the expert group across nodes) and shard groups change them."""
    import json

    from tests.mpirun import run_mpi
    from tests.test_estimate_flags import GPT, MOE_OPTS, cli_json
    from tests.test_moe_ep import metrics_of
    topos = [(3, ["--node-size", "2", "--hpz"]), (2, ["--node-size", "2", "--shard-size", "2"]),
             (3, ["--node-size", "1", "--hpz"]), (1, ["--node-size", "2"])]
    configs = [BASE + ["--dtype", "fp16", "--steps", "2", "--pp", "2", "--stage", str(z)] + t for z, t in topos]
    runs = metrics_of(run_mpi(8, ["tests/drivers/metrics_by_rank.py", json.dumps(configs)], timeout=600))
    assert len(runs) == len(topos)
    dims = list(GPT)
    dims[dims.index("--ranks") + 1], dims[dims.index("--batch") + 1] = "8", "16"
    base = dims + MOE_OPTS + ["--ep", 2, "--dtype", "fp16", "--bucket-mb", 0.004, "--pp", 2, "--micro-batches", 2]
    flat = cli_json(tmp_path, base)["moe"]["pipeline_stages"]
    compared = 0
    for (z, topo), m in zip(topos, runs):
        assert m["stage"] == z
        stages = cli_json(tmp_path, base + topo)["moe"]["pipeline_stages"]
        for rank, r in enumerate(m["by_rank"]):
            row, mem = stages[rank // 4]["zero_stages"][z], r["moe"]["memory_bytes_by_engine"]
            assert (row["dense_bytes"], row["expert_bytes"]) == (mem["dense"]["theory"], mem["experts"]["theory"]), \
                (topo, rank)
            assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                               mem["experts"]["measured"]), (topo, rank)
            # the stage's engines' ZeRO bytes in its nodes (and hpZ): this rank's collectives of a steady step
            # (stage 3: each chunk's one bucket kept gathered at the turn, as the estimate keeps it); the shard
            # groups' all-reduce across groups is not in them, as without --pp (test_moe_nodes.py, docs/estimate.md)
            sent = sum(r["comm_bytes_per_step_by_op"].values())
            if "--shard-size" not in topo:
                assert sent == row["comm_bytes_per_step"] - (row["comm_bytes_kept_at_turns"] if z == 3 else 0), \
                    (topo, rank, sent, row)
                compared += 1
        if topo != ["--node-size", "2"]:     # hpZ's copy, shard groups: other bytes than one group of the stage's
            assert stages[0]["zero_stages"][z]["padded_bytes"] != flat[0]["zero_stages"][z]["padded_bytes"], topo
    assert compared == 3 * 8


@pytest.mark.parametrize("topo,needle", [
    (["--node-size", "3"], "node_size=3 with pp=2: a node must lie inside one pipeline stage of 4 ranks or hold whole"),
    (["--shard-size", "8"], "shard_size=8 with pp=2: a shard group must lie inside one pipeline stage of 4 ranks"),
    (["--node-size", "2", "--shard-size", "2", "--ep", "4"], "--ep 4 with --shard-size 2: an EP group must fit"),
    (["--tp", "2", "--node-size", "2"], "--node-size with --pp 2 --tp 2 --experts 4 is not estimated yet (only "
                                        "nodes of whole stages"),
    (["--tp", "2", "--hpz"], "--hpz with --pp 2 --tp 2 --experts 4 is not estimated yet"),
])
def test_the_estimate_refuses_a_node_or_shard_group_across_stages(topo, needle, capsys):
    from tests.test_estimate_flags import GPT, MOE_OPTS
    from zerompi.estimate import cli
    dims = list(GPT)
    dims[dims.index("--ranks") + 1], dims[dims.index("--batch") + 1] = "8", "16"
    ep = [] if "--ep" in topo else ["--ep", "2"]
    assert cli.main(dims + MOE_OPTS + ep + ["--pp", "2", "--micro-batches", "2"] + topo) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_the_run_refuses_an_ep_group_across_a_shard_group():
    """N=8 --pp 2 --ep 4 in shard groups of 2 (inside a stage of 4): one line, exit 2, as without --pp."""
    from tests.mpirun import one_line, run_mpi
    proc = run_mpi(8, ["-m", "zerompi.train"] + BASE[:-4] + ["--batch", "16", "--pp", "2", "--ep", "4",
                                                             "--node-size", "2", "--shard-size", "2"], check=False)
    one_line(proc, 2, "--ep 4 with --shard-size 2: an EP group must fit in a shard group")


@pytest.mark.slow
def test_checkpoints_in_nodes_and_offload_resume_to_the_same_bits(tmp_path):
    """N=8 --pp 2 --ep 2 in nodes of 2: at stage 3 with hpZ and both offloads to files, and at stage 1 in shard
    groups of 2 with the optimizer in host memory, saved at step 2 and resumed to step 4: the bits of the run that
    never stopped (each chunk's expert part saved from its engine in its nodes, loaded back into it)."""
    F = BASE[:BASE.index("--steps")] + ["--eval-every", "4", "--ep", "2", "--batch", "16", "--pp", "2",
                                        "--node-size", "2", "--dtype", "fp32", "--steps"]
    off = tmp_path / "off"
    off.mkdir()
    a = ["--stage", "3", "--hpz", "--offload-optimizer", "nvme", "--offload-params", "nvme", "--offload-dir", str(off)]
    b = ["--stage", "1", "--shard-size", "2", "--offload-optimizer", "cpu"]
    runs = run_many(8, [F + ["4"] + a, F + ["2"] + a + ["--save-dir", str(tmp_path / "a")],
                        F + ["4"] + a + ["--resume", str(tmp_path / "a")],
                        F + ["4"] + b, F + ["2"] + b + ["--save-dir", str(tmp_path / "b")],
                        F + ["4"] + b + ["--resume", str(tmp_path / "b")]], timeout=900)
    assert len(runs) == 6
    for whole, resumed in ((runs[0], runs[2]), (runs[3], runs[5])):
        assert resumed["first_step"] == 2 and resumed["losses"] == whole["losses"][2:]
        assert resumed["final_params_sha256"] == whole["final_params_sha256"]
    assert (tmp_path / "a" / "pp1-of-2" / "ep1-of-2").is_dir()
    assert [p.name for p in off.rglob("*")] == []


def test_delayed_update_equals_unpipelined_and_ep1():
    """--offload-delayed-update (each engine's update one step behind; fp16 with skipped steps and clipping) with
    --pp 2 --ep 2: the bits of the unpipelined --ep 2 run with it and of --pp 2 --ep 1 with it."""
    d = FLAGS + ["--stage", "2", "--dtype", "fp16", "--loss-scale", "4194304", "--offload-optimizer", "cpu",
                 "--offload-delayed-update", "--offload-delayed-warmup", "1", "--steps", "8", "--clip", "0.5"]
    flat = run_many(2, [d + ["--ep", "2"]])
    piped = run_many(4, [d + ["--ep", "2", "--pp", "2"], d + ["--ep", "1", "--pp", "2"]])
    assert len(flat) == 1 and len(piped) == 2
    assert 0 < flat[0]["steps_applied"] < 8                  # some fp16 steps skipped, some applied
    for m in piped:
        for key in ("final_params_sha256", "losses", "val_losses", "steps_applied"):
            assert m[key] == flat[0][key], (key, m["flags"])


def test_replicas_in_nodes_keep_the_bits():
    """--replicas with N=8 --pp 2 --ep 2 in nodes of 2 with hpZ (stage 3): without a fault, the bits of the run
    without replicas (each chunk's expert engine, in its nodes, a part of the replicas)."""
    c = BASE + ["--dtype", "fp32", "--stage", "3", "--pp", "2", "--node-size", "2", "--hpz"]
    runs = run_many(8, [c, c + ["--replicas", "pp-ep-nodes"]], timeout=600)
    assert len(runs) == 2
    for key in ("final_params_sha256", "losses", "val_losses"):
        assert runs[1][key] == runs[0][key], key
