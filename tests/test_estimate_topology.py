"""zerompi.estimate across nodes (--node-size, --shard-size, --hpz, --intra-gbps, --inter-gbps):
against engine.traffic's list form, hand-computed figures for 10B parameters on 8 nodes of 8,
and the engine itself (bytes per level and memory measured by train runs under a topology)."""
import json
import random

import pytest

import zerompi
from zerompi import FlatLayout
from zerompi.comm.quantized import Quantization
from zerompi.engine import traffic
from zerompi.estimate import cli as estimate_cli, fromrun
from zerompi.train.models.mlp import init_mlp

from .mpirun import run_mpi
from .test_architecture import python as python_without_mpi

PSI, GB = 10 ** 10, 10 ** 9
QUANT = [None, Quantization(8, 64), Quantization(4, 32)]
NET = dict(intra_gbps=200.0, inter_gbps=25.0)


# ---- the run-length form of the traffic formula, against the list form --------------------------
def runs_of(lengths):
    out = []
    for b in lengths:
        if out and out[-1][0] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return [tuple(r) for r in out]


def test_step_bytes_runs_equal_the_list_form_on_the_engines_layouts():
    rng = random.Random(18)
    for _ in range(400):
        n = rng.choice([1, 2, 4, 6, 8, 12])
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        shard = rng.choice(divisors)
        node = rng.choice([d for d in divisors if shard % d == 0])
        sizes = [rng.choice([1, 5, 64, 300, 1000]) for _ in range(rng.randint(1, 12))]
        # cut as the engine cuts it: shard-size slices, each a multiple of align x shard groups
        lay = FlatLayout([(f"l{i}", [(f"p{i}", (s,))]) for i, s in enumerate(sizes)], shard,
                         rng.choice([64, 512, 2000]), 16 * (n // shard))
        lengths = [b.numel for b in lay.buckets]
        for stage in range(4):
            kw = dict(micro_batches=rng.randint(1, 3), ahead=rng.randint(0, 3), hpz=stage == 3 and rng.random() < 0.5,
                      weights=rng.choice(QUANT), grads=rng.choice(QUANT))   # quantized (issue 19) or not
            want = traffic.step_bytes(stage, lengths, 2, n, node, shard, **kw)
            assert traffic.step_bytes_runs(stage, runs_of(lengths), 2, n, node, shard, **kw) == want, (lengths, kw)


def test_ten_billion_parameters_become_a_few_runs():
    est = zerompi.estimate(params=10e9, ranks=64, node_size=8, **NET)
    assert est["buckets"] == 763
    # one run of 762 full buckets and the rest: no list of buckets, let alone of parameters
    calls = traffic.step_calls(3, [(13107200, 762), (12313600, 1)], 64, 8, 64, ahead=1)
    assert calls["reduce_scatter"] == {13107200: 762, 12313600: 1}
    assert calls["gather"] == {13107200: 762 * 2 - 1, 12313600: 1}


# ---- the seed's example, by hand: 10B parameters, 64 ranks as 8 nodes of 8, fp16 -----------------
# 25 MiB fp16 buckets: 762 of 13,107,200 elements and one of 12,313,600, none padded. Stage 3 with
# prefetch 1 does not gather again the last 2 buckets at the forward/backward turn.
KEPT = 13107200 + 12313600


def test_eight_nodes_of_eight_by_hand():
    calls_3 = 3 * 763 - 2         # stage 3: reduce-scatters and gathers of a step
    flat = zerompi.estimate(params=10e9, ranks=64, node_size=8, **NET)["stages"]
    groups = zerompi.estimate(params=10e9, ranks=64, node_size=8, shard_size=8, **NET)["stages"]
    hpz = zerompi.estimate(params=10e9, ranks=64, node_size=8, hpz=True, **NET)["stages"]
    # memory per rank: 16Ψ/N, with S = 8 in place of N, and hpZ's 2Ψ/K on top
    assert flat[3]["model_state_bytes"] == 16 * PSI // 64 == 2.5 * GB
    assert groups[3]["model_state_bytes"] == 16 * PSI // 8 == 20 * GB
    assert groups[2]["model_state_bytes"] == 2 * PSI + 14 * PSI // 8 == 37.5 * GB
    assert hpz[3]["secondary_bytes"] == 2 * PSI // 8 and hpz[3]["model_state_bytes"] == 5 * GB
    assert hpz[3]["formula"] == "16Ψ/N + 2Ψ/K" and groups[2]["formula"] == "2Ψ + 14Ψ/S"
    assert hpz[2]["secondary_bytes"] == 0 and hpz[2]["model_state_bytes"] == flat[2]["model_state_bytes"]
    # bytes across nodes: a two-level collective sends 1/K x (M-1)/M = 7/64 of a bucket across
    inter = lambda rows, s: rows[s]["comm_bytes_per_step_by_level"]["inter"]
    assert inter(flat, 3) == 2 * 7 * (3 * PSI - KEPT) // 64          # reduce-scatter, 2 gathers
    assert inter(hpz, 3) == 2 * 7 * (2 * PSI) // 64                   # the backward gathers stay inside
    assert inter(groups, 3) == inter(groups, 2) == 2 * 2 * 7 * (PSI // 8) // 8   # only the all-reduce of Ψ/S
    # flat collectives over the 64 (before two levels) send 56/64 of a bucket across nodes, 7/64 inside
    assert flat[3]["comm_bytes_per_step_if_flat"] == {"intra": 2 * 7 * (3 * PSI - KEPT) // 64,
                                                     "inter": 2 * 56 * (3 * PSI - KEPT) // 64}
    assert flat[3]["comm_seconds_per_step_if_flat"]["inter"] == \
        pytest.approx(calls_3 * 56 * 5e-6 + 2 * 56 * (3 * PSI - KEPT) // 64 * 8 / 25e9)
    assert flat[3]["comm_bytes_per_step_by_level"]["intra"] == 2 * 7 * (3 * PSI - KEPT) // 8
    # time: ring steps x 5 us + bytes / bandwidth per level; hpZ across nodes: 2 x 763 gathers/reduce-
    # scatters of 7 steps each; inside: the same 2 x 763 and the 763 - 2 backward gathers, 7 steps each
    assert hpz[3]["comm_seconds_per_step_by_level"]["inter"] == pytest.approx(2 * 763 * 7 * 5e-6 + 4.375 * 8 / 25)
    calls = calls_3
    intra_bytes = 2 * 7 * (3 * PSI - KEPT) // 8
    by_level = hpz[3]["comm_seconds_per_step_by_level"]
    assert by_level["intra"] == pytest.approx(calls * 7 * 5e-6 + intra_bytes * 8 / 200e9)
    assert hpz[3]["comm_seconds_per_step_levels"] == pytest.approx(sum(by_level.values()))


def test_one_node_is_the_flat_table():
    # no topology: every byte inside the node, and the by-level total is the engine's traffic formula
    one = zerompi.estimate(params=10e9, ranks=64)
    assert not one["by_level"] and one["nodes"] == 1
    for row in one["stages"]:
        assert row["comm_bytes_per_step_by_level"]["inter"] == 0
        assert row["comm_bytes_per_step_by_level"]["intra"] == \
            row["comm_bytes_per_step"] - row["comm_bytes_kept_at_turns"]


# ---- against the engine: train runs under topologies ------------------------------------------
WIDTH, DEPTH, BUCKET_MB = 20, 3, 0.002
TRAIN = """
import sys
from zerompi.errors import install_abort_hook
from zerompi.train.config import parse_config
from zerompi.train.run import train
install_abort_hook()
out, runs, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
for i, extra in enumerate(runs.split(";")):
    train(parse_config(flags + extra.split() + ["--metrics-json", f"{out}/r{i}.json"]))
"""
# --no-overlap: every collective is waited for as it starts, so each step's bytes are its own. With
# overlap, the second step of a two-level gather can start in the next step (the train CLI publishes
# stage 1/2 parameters lazily, stage 3 prefetches the next forward's first bucket), so the median over
# a few steps of the bytes inside a node depends on timing; across nodes it cannot (the first step
# starts at the call): those runs compare the bytes across nodes, and the buffers within their bounds.
SERIAL = " --no-overlap"
RUNS = {   # N: train flags of each run (stage, dtype, topology)
    4: ["--stage 3 --dtype fp16 --node-size 2 --hpz" + SERIAL,
        "--stage 2 --dtype fp32 --node-size 2 --micro-batches 2" + SERIAL,
        "--stage 3 --dtype fp32 --node-size 2 --shard-size 2" + SERIAL,
        "--stage 1 --dtype fp16 --node-size 1 --shard-size 2" + SERIAL,
        "--stage 3 --dtype fp32 --node-size 2 --hpz --micro-batches 2",
        "--stage 2 --dtype fp16 --node-size 2 --shard-size 2"],
    6: ["--stage 3 --dtype fp32 --node-size 3 --hpz --micro-batches 2" + SERIAL,
        "--stage 0 --dtype fp16 --node-size 2 --shard-size 2" + SERIAL,
        "--stage 3 --dtype fp16 --node-size 2"],
}


def mlp_layout(shard, replicas, dtype):
    """The MLP's layout as the engine cuts it under shard groups: shard-size slices, align x groups."""
    spec = [(name, [(p, a.shape) for p, a in params.items()]) for name, params in init_mlp(WIDTH, DEPTH, 0)]
    return FlatLayout(spec, shard, int(BUCKET_MB * 2 ** 20) // (2 if dtype == "fp16" else 4), 16 * replicas)


@pytest.mark.parametrize("n", sorted(RUNS))
def test_estimate_per_level_equals_the_engines_measured(tmp_path, n):
    run_mpi(n, ["-c", TRAIN, tmp_path, ";".join(RUNS[n]), "--model", "mlp", "--width", WIDTH, "--depth", DEPTH,
                "--bucket-mb", BUCKET_MB, "--steps", 3, "--batch", 4 * n], timeout=240)
    for i, flags in enumerate(RUNS[n]):
        m = json.loads((tmp_path / f"r{i}.json").read_text())
        topo, stage, dtype, zero = m["topology"], m["stage"], m["dtype"], m["config"]["zero"]
        assert topo["hpz"] == ("--hpz" in flags)
        serial = SERIAL in flags
        assert zero["overlap"] != serial
        kw = dict(ranks=n, dtype=dtype, bucket_mb=BUCKET_MB, micro_batches=zero["micro_batches"],
                  prefetch=zero["prefetch"], overlap=not serial, node_size=topo["node_size"],
                  shard_size=topo["shard_size"], hpz=topo["hpz"], **NET)
        layout = mlp_layout(topo["shard_size"], n // topo["shard_size"], dtype)
        assert layout.numel == m["padded_params"]
        by_layout = zerompi.estimate(layout=layout, **kw)["stages"][stage]
        by_shape = zerompi.estimate(params=m["params"], layers=DEPTH, **kw)["stages"][stage]
        # bytes per level: the estimate equals what the engine measured (a steady step, max over ranks)
        levels = ("intra", "inter") if serial else ("inter",)
        for lvl in levels:
            assert by_layout["comm_bytes_per_step_by_level"][lvl] == by_shape["comm_bytes_per_step_by_level"][lvl] \
                == m["comm_bytes_per_step_by_level"][lvl], (flags, lvl, by_layout["comm_bytes_per_step_by_level"])
        assert m["comm_bytes_per_step_by_level"]["inter"] > 0
        assert by_layout["comm_bytes_per_step_by_level"] == m["comm_theory_bytes_per_step_by_level"]   # the engine's
        # memory: model states (hpZ's secondary copy included) to the byte; with the buffers, between
        # the best case and the most the engine's cap allows (one figure with overlap off)
        mem = m["memory_bytes"]
        for row in (by_layout, by_shape):
            assert (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"], row["secondary_bytes"],
                    row["model_state_bytes"]) == (mem["params"], mem["grads"], mem["optimizer"],
                                                  mem.get("secondary", 0), mem["total"]), (flags, row, mem)
        total = mem["total"] + m["peak_buffer_bytes"]
        assert by_layout["total_bytes_best_case"] <= total <= by_layout["total_bytes"], (flags, total, by_layout)
        # --from-run reads the topology of the run and puts the levels beside the estimate
        cmp = fromrun.compare_run(fromrun.run_estimate(m), m)
        for lvl in levels:
            key = f"comm_{lvl}_bytes_per_step"
            assert cmp["measured"][key] == cmp["estimate"][key] == m["comm_bytes_per_step_by_level"][lvl]
        assert cmp["measured"]["model_state_bytes"] == cmp["estimate"]["model_state_bytes"]


# ---- the command line ----------------------------------------------------------------------------
def test_cli_prints_bytes_and_time_per_level(capsys, tmp_path):
    out = tmp_path / "e.json"
    argv = ["--params", "10e9", "--ranks", "64", "--node-size", "8", "--hpz", "--intra-gbps", "200",
            "--inter-gbps", "25", "--json", str(out)]
    assert estimate_cli.main(argv) == 0
    text = capsys.readouterr().out
    rows = {line[:32].strip(): line[32:].split() for line in text.splitlines() if line.startswith("  ")}
    assert rows["secondary copy (hpZ)"] == ["-", "-", "-", "2.5000"]
    assert rows["sent across nodes / step, GB"] == ["4.3750"] * 4
    assert rows["model states, GB"][-1] == "5.0000"
    assert "time across nodes, s" in rows and "communication time, s" in rows
    assert "hpZ: applies to the stage-3 column only" in text and "8 nodes of 8" in text
    data = json.loads(out.read_text())
    assert data["stages"] == zerompi.estimate(params=10e9, ranks=64, node_size=8, hpz=True, **NET)["stages"]
    assert data["hpz_applies"] and data["nodes"] == 8 and data["shard_groups"] == 1
    # hpZ with shard groups of one node changes nothing, and says so
    assert estimate_cli.main(["--params", "1e9", "--ranks", "16", "--node-size", "8", "--shard-size", "8",
                              "--hpz"]) == 0
    text = capsys.readouterr().out
    assert "no effect here: a shard group is one node" in text and "secondary copy" not in text


@pytest.mark.parametrize("argv,word", [
    (["--node-size", "3"], "node_size=3 does not divide the 64 ranks"),
    (["--node-size", "0"], "node_size=0 must be a whole number of ranks >= 1"),
    (["--node-size", "8", "--shard-size", "12"], "shard_size=12 is not allowed with 64 ranks in nodes of 8"),
    (["--node-size", "8", "--shard-size", "4"], "a multiple of the node size 8"),
    (["--shard-size", "8"], "no node_size given: all ranks on one node"),
    (["--node-size", "8", "--inter-gbps", "0"], "inter_gbps=0.0 must be a finite number > 0"),
    (["--intra-gbps", "inf"], "--intra-gbps: 'inf' is not a finite number"),
])
def test_bad_topology_is_one_line_and_exit_2(capsys, argv, word):
    assert estimate_cli.main(["--params", "10e9", "--ranks", "64"] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerompi.estimate: error:") and word in err, err


def test_layout_must_be_cut_for_the_shard_group():
    lay = mlp_layout(4, 1, "fp32")
    with pytest.raises(zerompi.ConfigError, match="layout is cut for 4 ranks; .* must be cut for 2"):
        zerompi.estimate(layout=lay, ranks=4, node_size=2, shard_size=2)


def test_levels_run_without_mpi():
    run = ("import runpy; sys.argv = ['zerompi.estimate'] + sys.argv[1:]; "
           "runpy.run_module('zerompi.estimate', run_name='__main__')")
    out = python_without_mpi(run, "--params", "10e9", "--ranks", "64", "--node-size", "8", "--shard-size", "8",
                             "--intra-gbps", "200", "--inter-gbps", "25").stdout
    assert "sent across nodes / step" in out and "8 shard groups of S = 8" in out
