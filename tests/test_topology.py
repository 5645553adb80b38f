"""Across nodes (comm/topology.py, comm/hierarchical.py): nodes simulated on one machine with
node_size, shard groups (MiCS / hybrid sharding) and hpZ, against the float64 oracle (the
collectives), the flat engine (losses and parameters to fp32 rounding), each other (stages
0-3 bit-identical for a topology) and the formulas (bytes per level and memory, to the byte).
"""
import json

import numpy as np
import pytest

from tests.mpirun import ROOT, run_mpi
from zerompi import ConfigError, MeshConfig, ZeroConfig
from zerompi.comm.topology import Topology
from zerompi.engine import traffic

DRIVER = ROOT / "tests" / "drivers" / "topology.py"
WIDTH, DEPTH, BATCH = 32, 4, 24


# ---- the two-level collectives --------------------------------------------------------------
@pytest.mark.parametrize("n,node", [(4, 2), (6, 3), (6, 2), (4, 1)])
def test_two_level_collectives_match_the_oracle_and_count_bytes_per_level(n, node):
    proc = run_mpi(n, [ROOT / "tests" / "drivers" / "hier_comm.py", node], timeout=90)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * 3 * 4, proc.stdout
    assert not [r for r in rows if r["wrong"]], rows
    for r in rows:
        if "intra" in r:
            assert (r["intra"], r["inter"]) == (r["intra_formula"], r["inter_formula"]), r


# ---- the engine under a topology ----------------------------------------------------------------
def runs(tmp_path, n, configs, steps=4, load=None, save=None, tag="r"):
    args = [DRIVER, tmp_path / tag, steps, WIDTH, DEPTH, BATCH, json.dumps(configs)]
    if load or save:
        args += [load or "-"] + ([save] if save else [])
    proc = run_mpi(n, args, timeout=180)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(configs), proc.stdout + proc.stderr
    for i, r in enumerate(out):
        r["params"] = dict(np.load(tmp_path / f"{tag}{i}.npz"))
    return out


def same_bits(a, b):
    return all(np.array_equal(a[k], b[k]) for k in a)


TOPOLOGIES = [   # (N, node_size, shard_size, hpz, dtype, micro_batches, bucket_mb)
    (4, 2, 4, False, "fp32", 1, 0.004),
    (4, 2, 4, True, "fp16", 2, 0.004),
    (4, 2, 2, False, "fp16", 1, 0.004),
    (4, 1, 2, True, "fp32", 2, 0.002),
    (6, 3, 6, True, "fp32", 1, 0.004),
    (6, 3, 3, False, "fp32", 2, 0.004),
    (6, 2, 6, True, "fp16", 1, 0.004),
    (6, 2, 2, False, "fp32", 1, 0.004),
]


@pytest.mark.parametrize("n,node,shard,hpz,dtype,micro,mb", TOPOLOGIES)
def test_stages_are_bit_identical_and_match_the_formulas(tmp_path, n, node, shard, hpz, dtype, micro, mb):
    base = dict(dtype=dtype, micro_batches=micro, bucket_mb=mb, node_size=node, shard_size=shard)
    out = runs(tmp_path, n, [dict(base, stage=s, hpz=hpz and s == 3) for s in range(4)])
    for r in out:
        assert r["steady"], r["config"]
        assert r["bytes_by_level"] == r["formula_by_level"], r["config"]
        assert r["memory"] == r["memory_formula"], r["config"]
        if node < n:
            assert r["bytes_by_level"]["inter"] > 0
        assert r["secondary"] == (hpz and r["config"]["stage"] == 3 and shard > node)
    for r in out[1:]:
        assert same_bits(r["params"], out[0]["params"]), r["config"]
        assert r["losses"] == out[0]["losses"], r["config"]


def test_hpz_gives_the_same_bits_and_keeps_the_backward_inside_the_node(tmp_path):
    base = dict(stage=3, dtype="fp32", bucket_mb=0.002, node_size=2, prefetch=0)
    plain, hpz = runs(tmp_path, 4, [base, dict(base, hpz=True)])
    assert same_bits(plain["params"], hpz["params"])
    # Without hpZ every gather crosses; with it only the first forward's: about half of them here.
    assert hpz["bytes_by_level"]["inter"] < 0.8 * plain["bytes_by_level"]["inter"]
    assert hpz["memory"]["secondary"] == hpz["memory_formula"]["secondary"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_against_the_flat_engine_fp32_losses_agree_to_rounding(tmp_path, stage):
    """50 steps, fp32: the flat engine and two-level collectives, shard groups and hpZ."""
    base = dict(stage=stage, dtype="fp32", bucket_mb=0.004)
    variants = [dict(base, node_size=2), dict(base, node_size=2, shard_size=2),
                dict(base, node_size=1, shard_size=2)] + ([dict(base, node_size=2, hpz=True)] if stage == 3 else [])
    out = runs(tmp_path, 4, [base] + variants, steps=50)
    flat = np.array(out[0]["losses"])
    for r in out[1:]:
        rel = np.max(np.abs(np.array(r["losses"]) - flat) / np.abs(flat))
        assert rel < 1e-5, (r["config"], rel)
        for k, v in out[0]["params"].items():
            np.testing.assert_allclose(r["params"][k], v, rtol=0, atol=1e-5)


def test_fp16_against_the_flat_engine(tmp_path):
    """fp16: the node's partial sum is rounded to fp16 before it crosses; measured tolerance."""
    base = dict(stage=2, dtype="fp16", bucket_mb=0.004)
    out = runs(tmp_path, 4, [base, dict(base, node_size=2), dict(base, node_size=2, shard_size=2)], steps=20)
    flat = np.array(out[0]["losses"])
    for r in out[1:]:
        rel = np.max(np.abs(np.array(r["losses"]) - flat) / np.abs(flat))
        assert rel < 2e-3, (r["config"], rel)


# ---- checkpoints across topologies ------------------------------------------------------------------
@pytest.mark.parametrize("before,after", [
    (dict(stage=2, node_size=2, shard_size=2), dict(stage=3, node_size=1)),
    (dict(stage=3, node_size=2, hpz=True), dict(stage=1, node_size=2, shard_size=2)),
    (dict(stage=1), dict(stage=3, node_size=1, shard_size=2)),
])
def test_checkpoints_load_across_shard_and_node_sizes(tmp_path, before, after):
    common = dict(dtype="fp32", bucket_mb=0.004)
    saved = runs(tmp_path, 4, [dict(common, **before)], steps=3, save=tmp_path / "ck", tag="a")[0]
    loaded = runs(tmp_path, 4, [dict(common, **after)], steps=0, load=tmp_path / "ck", tag="b")[0]
    assert same_bits(saved["params"], loaded["params"])
    # Continue one step from the checkpoint in both topologies: equal to fp32 rounding.
    a = runs(tmp_path, 4, [dict(common, **before)], steps=2, load=tmp_path / "ck", tag="c")[0]
    b = runs(tmp_path, 4, [dict(common, **after)], steps=2, load=tmp_path / "ck", tag="d")[0]
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5)


# ---- the formula and bad input --------------------------------------------------------------------
def test_traffic_formula_single_node_is_the_classic_table():
    """One node, one group: stages 0-2 send 2 passes of (N-1)/N Psi (+1 reduce-scatter per extra
    micro-batch), stage 3 the estimate's 3 passes per micro-batch less what the turns keep."""
    import zerompi
    from zerompi.layout import FlatLayout
    lay = FlatLayout([(f"l{i}", [(f"p{i}", (n,))]) for i, n in enumerate([300, 700, 64, 1000, 5])], 4, 512, 16)
    sizes = [b.numel for b in lay.buckets]
    for stage in range(4):
        for micro, ahead in ((1, 0), (2, 1), (3, 2)):
            got = traffic.step_bytes(stage, sizes, 2, 4, 4, 4, micro_batches=micro, ahead=ahead)
            assert got["inter"] == 0
            if stage < 3:
                assert got["intra"] == (micro + 1) * 2 * lay.numel * 3 // 4
            else:
                est = zerompi.estimate(layout=lay, dtype="fp16", micro_batches=micro, prefetch=ahead)["stages"][3]
                assert got["intra"] == est["comm_bytes_per_step"] - est["comm_bytes_kept_at_turns"], (micro, ahead)


@pytest.mark.parametrize("kw,match", [
    (dict(size=6, node_size=4, shard_size=6), "node_size=4 does not divide the 6 ranks"),
    (dict(size=8, node_size=2, shard_size=3), "shard_size=3 is not allowed with 8 ranks"),
    (dict(size=8, node_size=4, shard_size=2), "multiple of the node size 4"),
])
def test_topologies_that_do_not_fit_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        Topology(**kw)


def test_hpz_outside_stage_3_is_refused():
    with pytest.raises(ConfigError, match="hpz=True needs stage 3"):
        ZeroConfig(stage=2, hpz=True)
    with pytest.raises(ConfigError, match="shard_size=3 is not a multiple of node_size=2"):
        MeshConfig(node_size=2, shard_size=3)
    with pytest.warns(DeprecationWarning, match="MeshConfig"):      # the old place, for one release
        assert ZeroConfig(node_size=2, shard_size=4).shard_size == 4


def test_env_node_size_is_checked(monkeypatch):
    from zerompi.comm.topology import placement_from
    with pytest.raises(ConfigError, match="ZEROMPI_NODE_SIZE='two' is not allowed"):
        placement_from(None, None, {"ZEROMPI_NODE_SIZE": "two"})
    assert placement_from(None, None, {"ZEROMPI_NODE_SIZE": "2"}) == (2, None)   # simulated nodes: blocks
