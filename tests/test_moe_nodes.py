"""Expert parallelism over nodes (--node-size, two-level collectives), shard groups (--shard-size) and hpZ:
every --ep gives the bits of --ep 1 with the same nodes (final parameters, losses, held-out losses, routing),
and each rank's bytes equal the formula. --trace, --comm-progress thread and the offload (host memory, files) do
not change a bit; the delayed update gives --ep 1's bits with it. The case that once took a wrong slice
silently: 2 nodes x 4 ranks, --ep 2 (docs/moe.md)."""
import json

import pytest

from tests.mpirun import one_line, run_mpi
from tests.test_moe_ep import FLAGS, run_many, same_run


def ep_of(flags):
    return int(flags[flags.index("--ep") + 1])


def without_ep(flags):
    i = flags.index("--ep")
    return tuple(flags[:i] + flags[i + 2:])


def check_against_ep1(runs, want_eps):
    """Every run the bits of the --ep 1 run of the same other flags; its bytes its formula's."""
    ref = {without_ep(m["flags"]): m for m in runs if ep_of(m["flags"]) == 1}
    seen = set()
    for m in runs:
        same_run(m, ref[without_ep(m["flags"])])
        assert m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"], m["flags"]
        seen.add(ep_of(m["flags"]))
    assert seen == set(want_eps)


@pytest.mark.slow
def test_two_nodes_of_four():
    """N = 8 in nodes of 4: --ep 2 (an EP group inside a node: the node level exchanges the partials), --ep 4
    (one EP group per node) and --ep 8 (an EP group over both nodes: each rank sums its nodes' partials)."""
    base = FLAGS + ["--batch", "16", "--experts", "8", "--node-size", "4"]
    configs = [base + ["--dtype", "fp32", "--stage", str(s), "--ep", str(ep)] for s in (1, 3) for ep in (1, 2, 4, 8)]
    configs += [base + ["--dtype", "fp32", "--stage", "3", "--hpz", "--ep", str(ep)] for ep in (1, 2, 4)]
    configs += [base + ["--dtype", "fp16", "--stage", "2", "--ep", str(ep)] for ep in (1, 2)]
    runs = run_many(8, configs, timeout=900)
    assert len(runs) == len(configs)
    check_against_ep1(runs, (1, 2, 4, 8))
    # the nodes' order of summation is not the flat one: the two-level bits differ from one node's
    flat = run_many(8, [FLAGS + ["--batch", "16", "--experts", "8", "--dtype", "fp32", "--stage", "1", "--ep", "2"]])[0]
    assert flat["final_params_sha256"] != runs[0]["final_params_sha256"]


@pytest.mark.slow
def test_with_tensor_parallelism():
    """N = 8, --tp 2 (the experts whole on each TP rank): nodes of 4 world ranks (2 data-parallel ranks: --ep 2 an
    EP group per node), nodes of 2 (1 data-parallel rank: --ep 2, 4 across nodes); the bits of --ep 1."""
    configs = [FLAGS + ["--tp", "2", "--node-size", "4", "--dtype", "fp32", "--stage", "1", "--ep", str(ep)]
               for ep in (1, 2)]
    configs += [FLAGS + ["--tp", "2", "--node-size", "2", "--dtype", "fp32", "--stage", "3", "--ep", str(ep)]
                for ep in (1, 2, 4)]
    runs = run_many(8, configs, timeout=900)
    assert len(runs) == len(configs)
    check_against_ep1(runs, (1, 2, 4))


@pytest.fixture(scope="module")
def n4():
    """N = 4: nodes of 2 (--ep 2 inside, --ep 4 across), nodes of 1 (every EP group across nodes), shard groups
    of 2 with micro-batches, hpZ; stages 0 and 2 (3 with hpZ)."""
    configs = []
    for extra, eps in ((["--node-size", "2"], (1, 2, 4)), (["--node-size", "1"], (1, 2, 4)),
                       (["--node-size", "2", "--shard-size", "2", "--micro-batches", "2", "--batch", "16"], (1, 2))):
        configs += [FLAGS + extra + ["--dtype", "fp32", "--stage", str(s), "--ep", str(ep)]
                    for s in (0, 2) for ep in eps]
    configs += [FLAGS + ["--node-size", "2", "--hpz", "--dtype", "fp32", "--stage", "3", "--ep", str(ep)]
                for ep in (1, 2, 4)]
    runs = run_many(4, configs)
    assert len(runs) == len(configs)
    return runs


def test_nodes_and_shard_groups_n4(n4):
    check_against_ep1(n4, (1, 2, 4))


def test_the_estimate_with_nodes_equals_the_runs(n4, tmp_path):
    """`zerompi.estimate --experts --ep K` with the same nodes, shard groups and hpZ: each engine's model states
    with its padding are the run's; the ZeRO bytes per step (both engines, the expert reduce-scatters' partials by
    level) the run's at stages 0-2 without shard groups (stage 3's turn and the shard groups' all-reduce are
    counted as the estimate counts them for any run: docs/estimate.md)."""
    from tests.test_estimate_flags import GPT, cli_json
    compared = 0
    for m in n4:
        f, ep, stage = m["flags"], ep_of(m["flags"]), m["stage"]
        if ep == 1:
            continue
        topo = f[len(FLAGS):f.index("--dtype")]
        argv = GPT + ["--experts", 4, "--top-k", 2, "--expert-hidden", 24, "--ep", ep, "--dtype", "fp32",
                      "--bucket-mb", 0.004] + topo
        est = cli_json(tmp_path, argv)
        row, mem = est["moe"]["stages"][stage], m["moe"]["memory_bytes_by_engine"]
        assert (row["dense_padded_bytes"], row["expert_padded_bytes"]) == (mem["dense"]["measured"],
                                                                           mem["experts"]["measured"]), f
        if stage < 3 and "--shard-size" not in topo:
            assert est["stages"][stage]["comm_bytes_per_step"] + row["expert_comm_bytes_per_step"] == \
                m["comm_bytes_per_step"], f
            compared += 1
    assert compared == 8


def test_trace_progress_thread_offload_keep_the_bits(tmp_path):
    """At --ep 2 each of them is the run without it, bit for bit (the delayed update, which changes the arithmetic,
    against --ep 1 with it: fp16 with skipped steps and clipping); the trace has the dense engine's timeline and
    one per EP rank for the expert engine; the offload files are gone at the end."""
    trace, off = tmp_path / "t.json", tmp_path / "off"
    off.mkdir()
    base = FLAGS + ["--dtype", "fp32", "--ep", "2"]
    nvme = ["--offload-dir", str(off)]
    configs = [base + ["--stage", "3"], base + ["--stage", "3", "--trace", str(trace)],
               base + ["--stage", "3", "--comm-progress", "thread"],
               base + ["--stage", "3", "--offload-params", "nvme", "--offload-optimizer", "nvme"] + nvme,
               base + ["--stage", "2"], base + ["--stage", "2", "--offload-optimizer", "cpu"],
               base + ["--stage", "2", "--offload-optimizer", "nvme"] + nvme]
    delayed = FLAGS + ["--stage", "2", "--dtype", "fp16", "--loss-scale", "4194304", "--offload-optimizer", "cpu",
                       "--offload-delayed-update", "--offload-delayed-warmup", "1", "--steps", "8", "--clip", "0.5"]
    configs += [delayed + ["--ep", "1"], delayed + ["--ep", "2"]]
    runs = run_many(4, configs)
    assert len(runs) == len(configs)
    for i in (1, 2, 3):
        same_run(runs[i], runs[0])
    for i in (5, 6):
        same_run(runs[i], runs[4])
    same_run(runs[8], runs[7])
    assert 0 < runs[8]["steps_applied"] < 8                 # some fp16 steps skipped, some applied
    assert runs[8]["final_params_sha256"] != runs[4]["final_params_sha256"]
    for name in ("t.json", "t.ep0-of-2.json", "t.ep1-of-2.json"):
        events = json.loads((tmp_path / name).read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        assert any(e.get("ph") == "X" for e in events), name
    assert [p.name for p in off.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("n,argv,needle", [
    (6, ["--node-size", "3", "--ep", "2"], "--ep 2 with nodes of 3 ranks: an EP group must fit in a node or span"),
    (4, ["--node-size", "2", "--shard-size", "2", "--ep", "4"], "--ep 4 with --shard-size 2: an EP group must fit"),
])
def test_uneven_groups_refused_in_one_line(n, argv, needle):
    proc = run_mpi(n, ["-m", "zerompi.train"] + FLAGS + ["--batch", "12"] + argv, check=False)
    one_line(proc, 2, needle)
