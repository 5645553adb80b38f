"""Nodes found from MPI's shared-memory split, whatever the placement (comm/topology.py).

MPICH can split one machine into fake nodes: ``MPIR_CVAR_NUM_CLIQUES=M`` deals the ranks out to
M nodes round-robin (node 0 holds ranks 0, M, 2M, ...), with ``MPIR_CVAR_CLIQUES_BY_BLOCK=1`` in
blocks. Both must give the bits of the same ranks with ``node_size`` set (the engine numbers
round-robin ranks node by node), and the bytes per level their formula. Unequal nodes are one
line, printed once. Across real (emulated) nodes: tests/test_cluster_parity.py.
"""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, launcher, one_line, run_mpi

DRIVER = ROOT / "tests" / "drivers" / "topology.py"
pytestmark = pytest.mark.skipif(launcher() != "mpich", reason="MPIR_CVAR_NUM_CLIQUES is MPICH's")
CONFIGS = [dict(stage=2, dtype="fp32", bucket_mb=0.004),
           dict(stage=3, dtype="fp16", bucket_mb=0.004, hpz=True, micro_batches=2),
           dict(stage=3, dtype="fp32", bucket_mb=0.004, shard_size=2)]


def runs(tmp_path, tag, env, node_size=None):
    configs = [dict(c, node_size=node_size) if node_size else c for c in CONFIGS]
    proc = run_mpi(4, [DRIVER, tmp_path / tag, 3, 32, 4, 24, json.dumps(configs)], timeout=120, env=env)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(configs), proc.stdout + proc.stderr
    for i, r in enumerate(out):
        r["params"] = dict(np.load(tmp_path / f"{tag}{i}.npz"))
    return out


def test_round_robin_and_block_nodes_are_found_and_give_the_bits_of_node_size(tmp_path):
    simulated = runs(tmp_path, "sim", {}, node_size=2)
    for tag, env in (("rr", {"MPIR_CVAR_NUM_CLIQUES": "2"}),
                     ("block", {"MPIR_CVAR_NUM_CLIQUES": "2", "MPIR_CVAR_CLIQUES_BY_BLOCK": "1"})):
        found = runs(tmp_path, tag, env)
        for f, s in zip(found, simulated):
            assert f["topology"] == s["topology"], (tag, f["topology"])
            assert f["topology"].startswith("2 nodes of 2"), f["topology"]
            assert all(np.array_equal(f["params"][k], s["params"][k]) for k in s["params"]), (tag, f["config"])
            assert f["bytes_by_level"] == f["formula_by_level"] == s["bytes_by_level"], (tag, f)


def test_nodes_of_different_sizes_are_one_line_printed_once(tmp_path):
    proc = run_mpi(3, ["-m", "zerompi.train", "--model", "mlp", "--steps", "1", "--batch", "24"], timeout=60,
                   env={"MPIR_CVAR_NUM_CLIQUES": "2"}, check=False)
    one_line(proc, 2, "the nodes hold different numbers of ranks (node 0: ranks [0, 2]; node 1: ranks [1])")
