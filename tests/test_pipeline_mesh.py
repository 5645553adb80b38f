"""The mesh with pipeline stages (comm/mesh.py): world rank = tp_i + TP * (sp_i + SP * (dp_i + DP * pp_i)), the groups
of each axis, the point-to-point messages between stages (comm/p2p.py) and an engine per stage.

Judged against the rank arithmetic written out here, at odd and even world sizes (6 and 8 ranks)."""
import json

import pytest

from tests.mpirun import ROOT, run_mpi

DRIVER = ROOT / "tests" / "drivers" / "pipeline_mesh.py"
SPECS = {6: [[1, 1, 2], [1, 1, 3], [3, 1, 2], [2, 1, 3], [1, 1, 6], [6, 1, 1], [1, 1, 1], [1, 3, 2], [1, 2, 3]],
         8: [[2, 1, 2], [1, 1, 4], [2, 1, 4], [1, 1, 8], [2, 2, 2], [1, 2, 2]]}     # [tp, sp, pp]


def expected(n, tp, sp, pp, rank):
    """(coords, ranks of the stage, pipeline group, members of each group) by the formula."""
    dp = n // (tp * sp * pp)
    at = lambda t, s, d, p: t + tp * (s + sp * (d + dp * p))
    t, s, d, p = rank % tp, (rank // tp) % sp, (rank // (tp * sp)) % dp, rank // (tp * sp * dp)
    return {"coords": [t, s, d, p], "dp": dp,
            "ranks": [[at(tt, ss, dd, p) for tt in range(tp)] for dd in range(dp) for ss in range(sp)],
            "pp_ranks": [at(t, s, d, pp_i) for pp_i in range(pp)],
            "zero_ranks": [at(t, ss, dd, p) for dd in range(dp) for ss in range(sp)],
            "members": {"tp": [at(tt, s, d, p) for tt in range(tp)], "sp": [at(t, ss, d, p) for ss in range(sp)],
                        "zero": [at(t, ss, dd, p) for dd in range(dp) for ss in range(sp)],
                        "pp": [at(t, s, d, pp_i) for pp_i in range(pp)],
                        "stage": [at(tt, ss, dd, p) for dd in range(dp) for ss in range(sp) for tt in range(tp)]}}


@pytest.fixture(scope="module", params=sorted(SPECS))
def launched(request):
    n = request.param
    out = run_mpi(n, [DRIVER, json.dumps(SPECS[n])], timeout=120).stdout
    return n, json.loads(next(line[5:] for line in out.splitlines() if line.startswith("MESH ")))


def test_coordinates_groups_and_messages(launched):
    n, got = launched
    for r, rows in enumerate(got["rows"]):
        assert [[row["tp"], row["sp"], row["pp"]] for row in rows] == SPECS[n]
        for row in rows:
            tp, sp, pp = row["tp"], row["sp"], row["pp"]
            want = expected(n, tp, sp, pp, r)
            assert row["rank"] == r and row["zero_comm"] == want["dp"] * sp
            for key in ("coords", "dp", "ranks", "pp_ranks", "zero_ranks", "members"):
                assert row[key] == want[key], (n, tp, sp, pp, r, key, row[key], want[key])
            p = want["coords"][3]
            if pp > 1:      # the previous stage's world rank arrived; 3 float32 values sent to the next stage
                assert row["got"] == (None if p == 0 else [float(want["pp_ranks"][p - 1])] * 3)
                assert row["sent"] == (12 if p < pp - 1 else 0)
                assert "pipeline neighbours" in row["describe"]
    if n == 6:      # bad meshes: one line naming the value and what is allowed
        assert got["errors"] == [
            "pp=4 does not divide the 6 ranks left by tp=1; use a divisor of 6",
            "pp=6 does not divide the 3 ranks left by tp=2; use a divisor of 3",
            None, None, None,
            "node_size=4 does not divide the 6 ranks; use a divisor of 6",
            "node_size=2 with pp=2: a node must lie inside one pipeline stage of 3 ranks or hold whole stages; "
            "use a divisor or a multiple of 3",
            "shard_size=4 with pp=3: a shard group lies inside one pipeline stage of 2 ranks; use a divisor of 2",
            "pp=0 must be a whole number of stages >= 1",
            "config.pp=2: an engine holds one pipeline stage's chunk; pass it the zerompi.Mesh(tp=..., pp=...) and "
            "run the stages with zerompi.pipeline (docs/pipeline.md)",
            "begin_step() twice without finish_step(); finish the step begun first",
            "finish_step() needs the PendingStep this engine's begin_step() returned, once",
            True]


def test_an_engine_per_stage_over_a_mesh_without_tp(launched):
    """Each stage's engine has its own layers (stage-wide agreement, not world-wide) and averages over its
    data- x sequence-parallel group: grads 1, 2, ... on DP ranks 0, 1, ... (the same on a DP rank's SP ranks);
    the first AdamW step moves 0.5 by lr."""
    n, got = launched
    seen = 0
    for rows in got["rows"]:
        for row in rows:
            if "engine" in row:
                e, dp, width = row["engine"], row["dp"], 4 + row["coords"][3]
                mean = (dp + 1) / 2
                assert e["world"] == dp * row["sp"] and e["norm"] == pytest.approx(mean * width ** 0.5, rel=1e-6)
                assert e["value"] == pytest.approx([0.4] * width, rel=1e-6)
                seen += 1
    assert seen == n * sum(1 for tp, sp, pp in SPECS[n] if pp > 1 and tp == 1)
