"""Schedules as data (zerompi/pipeline/): the shipped schedules, the validator, the simulator, the file
format and ``python -m zerompi.estimate --pp``. Pure Python, no MPI.

Oracles: the closed forms of the bubble on equal costs (GPipe and 1F1B (P-1)/(m+P-1); interleaved
(P-1)/(vm+P-1) (Megatron-LM, Narayanan et al. 2021); ZB-H1 (P-1)/(3m+P-1) when F = B = W (Qi et al.
2023)), the peak activations each schedule is known for, and hand-built broken schedules.
"""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import zerompi

from tests.mpirun import ROOT
from zerompi.errors import ConfigError
from zerompi.pipeline import actions, schedules, timeline, validate
from zerompi.pipeline.actions import Action, Schedule, ScheduleError

CASES = [(name, p, m, v) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8) for name, v in
         (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3))
         if name == "gpipe" or (m % p == 0 if name == "interleaved" else m >= p)]


def closed_form(name, p, m, v):
    return {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (v * m + p - 1),
            "zb-h1": (p - 1) / (3 * m + p - 1)}[name]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_shipped_schedules_are_valid_and_have_their_bubble(name, p, m, v):
    s = validate.check(schedules.make(name, p, m, v), micro_batches=m, ranks=p)
    assert (s.ranks, s.micro_batches, s.chunks) == (p, m, p * v)
    assert s.placement() == {c: c % p for c in range(p * v)}
    for r, acts in enumerate(s.actions):          # each chunk's backwards in micro-batch order: the engine's sums
        for c in s.chunks_of(r):
            for kind in ("B", "W"):
                order = [a.mb for a in acts if a.kind == kind and a.chunk == c]
                assert order == (list(range(m)) if kind == "B" or name == "zb-h1" else [])
    sim = timeline.run(s)
    assert sim.bubble_fraction == pytest.approx(closed_form(name, p, m, v), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_peak_activations(p, m):
    """GPipe holds every micro-batch; 1F1B P - r on rank r; ZB-H1 P on every rank (its W's wait, no more);
    interleaved on rank 0: 2(P-1) + (v-1)P + 1 chunk micro-batches, when m allows so many."""
    assert timeline.run(schedules.make("gpipe", p, m)).peak_in_flight == [m] * p
    assert timeline.run(schedules.make("1f1b", p, m)).peak_in_flight == [min(p - r, m) for r in range(p)]
    assert timeline.run(schedules.make("zb-h1", p, m)).peak_in_flight == [p] * p
    assert timeline.in_flight(schedules.make("1f1b", p, m), 0) == {0: p}
    if m % p == 0:
        s = schedules.make("interleaved", p, m, 2)
        held = timeline.run(s).peak_in_flight
        assert held[0] == min(2 * (p - 1) + p + 1, 2 * m) and held == sorted(held, reverse=True)
        assert sum(timeline.in_flight(s, 0).values()) >= held[0] and timeline.run(s).peak_activations == held[0] / 2


def test_unequal_costs_and_latency():
    """1F1B on P = 2, m = 2 with F = 1, B + W = 3 and a message latency of 0.5, worked by hand: rank 1's F0
    waits for rank 0's output (1 + .5) and runs 1.5-2.5, its B0 2.5-5.5, F1 5.5-6.5, B1 6.5-9.5; rank 0 runs
    F0 0-1, F1 1-2, then B0 when the gradient is there (5.5 + .5) 6-9 and B1 (9.5 + .5) 10-13: the span is 13,
    each rank computed 8 of it."""
    s = schedules.make("1f1b", 2, 2)
    sim = timeline.run(s, timeline.unit_costs(s, 1.0, 2.0, 1.0), latency=0.5)
    assert sim.makespan == pytest.approx(13.0) and sim.busy == [8.0, 8.0]
    assert sim.bubble_fraction == pytest.approx(1 - 8 / 13)
    spans = {(str(a), r): (t0, t1) for r, ss in enumerate(sim.spans) for a, t0, t1 in ss}
    assert spans[("0B0", 0)] == (6.0, 9.0) and spans[("0B1", 0)] == (10.0, 13.0)
    assert spans[("1F0", 1)] == (1.5, 2.5) and spans[("1F1", 1)] == (5.5, 6.5)


def test_the_zero_bubble_schedule_has_less_bubble_than_1f1b():
    for p, m in ((2, 4), (4, 8), (4, 16)):
        assert timeline.run(schedules.make("zb-h1", p, m)).bubble_fraction < \
            timeline.run(schedules.make("1f1b", p, m)).bubble_fraction / 2


def test_the_file_format_round_trips(tmp_path):
    s = schedules.make("interleaved", 2, 4, 2)
    path = tmp_path / "s.csv"
    actions.write(s, str(path))
    text = path.read_text()
    assert text.startswith("# zerompi pipeline schedule interleaved") and "0F0" in text and "1SEND_B0" in text
    back = actions.read(str(path))
    assert back.actions == s.actions and validate.check(back) is back


def rows(*lines):
    return actions.parse("\n".join(lines), name="t")


BROKEN = [
    (rows("0F0,0B0,0SEND_F0", "0F0"), "chunk 0 is computed on ranks 0 and 1 (0F0); each chunk lives on one rank"),
    (rows("0F0,0SEND_F0,0RECV_B0,0B0", "2F0,2B0"), "chunks [1] are never computed; every chunk 0..2 needs its F and B"),
    (rows("0B0,0F0,0SEND_F0,0RECV_B0", "1RECV_F0,1F0,1B0,1SEND_B0"),
     "rank 0 runs 0B0 (action 0) before 0F0 (action 1); every forward comes before its backward"),
    (rows("0F0,0SEND_F0,0RECV_B0,0B0,0W0", "1RECV_F0,1F0,1B0,1SEND_B0"),
     "1W0 appears 0 times on rank 1; every micro-batch of every chunk needs one F and one B and one W"),
    (rows("0F0,0SEND_F0,0RECV_B0,0B0", "1F0,1B0,1SEND_B0"),
     "1RECV_F0 appears 0 times on rank 1; the boundary to a chunk on another rank needs it once"),
    (rows("0F0,0F1,0SEND_F1,0SEND_F0,0RECV_B0,0RECV_B1,0B0,0B1",
          "1RECV_F0,1RECV_F1,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1"),
     "rank 0 sends its activations to rank 1 in another order than rank 1 receives them (message 0: sent "
     "micro-batch 1 of chunk 0, received micro-batch 0 of chunk 0); MPI matches them by order"),
    (rows("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B1,0RECV_B0,0B1,0B0",
          "1RECV_F0,1RECV_F1,1F0,1F1,1B1,1SEND_B1,1B0,1SEND_B0"),
     "rank 0 runs B of micro-batch 0 after micro-batch 1 on chunk 0; each chunk's B must run in micro-batch order"),
    (rows("0RECV_B0,0B0,0F0,0SEND_F0", "1RECV_F0,1F0,1B0,1SEND_B0"),
     "rank 0 runs 0B0 (action 1) before 0F0 (action 2)"),
    (rows("0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1B0,1F0,1SEND_B0"),
     "rank 1 runs 1B0 (action 1) before 1F0 (action 2); every forward comes before its backward"),
    (rows("0F0,0SEND_F0,0RECV_B0,0B0,0F1,0SEND_F1,0RECV_B1,0B1",
          "1RECV_F1,1F1,1B1,1SEND_B1,1RECV_F0,1F0,1B0,1SEND_B0"),
     "rank 0 sends its activations to rank 1 in another order"),
]


@pytest.mark.parametrize("schedule,needle", BROKEN)
def test_broken_schedules_are_one_line_errors(schedule, needle):
    with pytest.raises(ScheduleError) as e:
        validate.check(schedule)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_deadlock_names_the_waiting_ranks():
    """Each rank's B waits for the other's: rank 0 needs 1's input gradient before it sends its output."""
    s = Schedule(((Action("RECV_B", 0, 0), Action("F", 0, 0), Action("B", 0, 0), Action("SEND_F", 0, 0)),
                  (Action("RECV_F", 0, 1), Action("F", 0, 1), Action("B", 0, 1), Action("SEND_B", 0, 1))), "t")
    with pytest.raises(ScheduleError, match="rank 0 runs 0SEND_F0 .* before|deadlock"):
        validate.check(s)
    s = Schedule(((Action("F", 0, 0), Action("RECV_B", 0, 0), Action("B", 0, 0), Action("SEND_F", 0, 0)),
                  (Action("RECV_F", 0, 1), Action("F", 0, 1), Action("B", 0, 1), Action("SEND_B", 0, 1))), "t")
    with pytest.raises(ScheduleError) as e:
        timeline.run(s)
    assert str(e.value) == ("deadlock: rank 0 waits at 0B0 (action 2); rank 1 waits at 1F0 (action 1): each waits "
                            "for data that another waiting rank has not sent")


def test_bad_files_and_arguments():
    with pytest.raises(ScheduleError, match=r"line 2 \(rank 1\): '1X0' is not an action"):
        actions.parse("0F0,0B0\n1X0\n")
    with pytest.raises(ScheduleError, match="no actions"):
        actions.parse("# nothing\n\n")
    with pytest.raises(ScheduleError, match="cannot be read"):
        actions.read("/nonexistent/schedule.csv")
    with pytest.raises(ScheduleError, match="it has 2 micro-batches, this run has 4"):
        validate.check(schedules.make("gpipe", 2, 2), micro_batches=4)
    for args, needle in ((("1f1b", 4, 3), "micro_batches=3 is too few for the 1f1b schedule on 4 stages; it needs at "
                                          "least 4 (the ranks) micro-batches"),
                         (("interleaved", 2, 3, 2), "it needs a multiple of 2 (the ranks) micro-batches"),
                         (("interleaved", 2, 4, 1), "needs at least 2 chunks per rank"),
                         (("1f1b", 2, 4, 2), "chunks=2 applies to the interleaved schedule only"),
                         (("pipedream", 2, 4), "schedule='pipedream' is not allowed; use one of gpipe, 1f1b, "
                                               "interleaved, zb-h1")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            schedules.make(*args)


def estimate(*args):
    return subprocess.run([sys.executable, "-m", "zerompi.estimate", *args], capture_output=True, text=True,
                          timeout=60, cwd=str(ROOT))


def test_the_estimator_prints_the_bubble_and_the_activations(tmp_path):
    out = estimate("--pp", "4", "--micro-batches", "8", "--schedule", "1f1b", "--json", tmp_path / "e.json")
    assert out.returncode == 0, out.stderr
    assert "bubble fraction        0.2727   (formula 0.2727)" in out.stdout
    assert ("peak activations       4 micro-batches of one stage's "
            "(chunk micro-batches held per rank: 4, 3, 2, 1)") in out.stdout
    est = json.loads((tmp_path / "e.json").read_text())
    assert est["bubble_fraction"] == pytest.approx(3 / 11) and est["peak_in_flight"] == [4, 3, 2, 1]
    # with --params and --ranks (--layers): one stage's memory table too, the estimate of Ψ/P over N/P ranks
    out = estimate("--pp", "8", "--micro-batches", "8", "--params", "10e9", "--ranks", "64", "--layers", "48",
                   "--json", tmp_path / "s.json")
    assert out.returncode == 0, out.stderr
    stage = json.loads((tmp_path / "s.json").read_text())["stage_table"]
    whole = zerompi.estimate(1.25e9, 8, "fp16", layers=6, micro_batches=8)
    assert [r["model_state_bytes"] for r in stage["stages"]] == [r["model_state_bytes"] for r in whole["stages"]]
    assert stage["stages"][1]["model_state_bytes"] == pytest.approx(6.875e9, rel=1e-5)   # 4Ψc + 12Ψc/8, padded
    assert stage["pipeline_stage"]["ranks"] == 8
    assert "one of 8 pipeline stages" in out.stdout and "6.8750" in out.stdout
    out = estimate("--pp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--chunks", "2").stdout
    assert "bubble fraction        0.1111   (formula 0.1111)" in out and "2.5 micro-batches" in out
    schedules_file = tmp_path / "s.csv"
    actions.write(schedules.make("zb-h1", 2, 4), str(schedules_file))
    out = estimate("--pp", "2", "--micro-batches", "4", "--schedule-file", schedules_file).stdout
    assert "bubble fraction        0.0769" in out and "(B and W split)" in out
    for args, needle in ((["--pp", "4", "--micro-batches", "2"], "micro_batches=2 is too few for the 1f1b"),
                         (["--pp", "2", "--params", "1e9", "--micro-batches", "2"],
                          "a stage's memory table needs --params and --ranks"),
                         (["--pp", "3", "--params", "1e9", "--ranks", "8", "--micro-batches", "3"],
                          "pp=3 does not divide ranks=8"),
                         (["--pp", "2", "--params", "1e9", "--ranks", "8", "--layers", "5", "--micro-batches", "2"],
                          "pp=2 does not divide layers=5"),
                         (["--pp", "2", "--n-layer", "4"], "drop --n-layer (not estimated per stage)"),
                         (["--pp", "2", "--params", "1e9", "--ranks", "8", "--hpz"], "drop --hpz"),
                         (["--schedule", "gpipe"], "need --pp P"),
                         (["--pp", "2", "--micro-batches", "4", "--costs", "1,x,1"], "costs='1,x,1' is not allowed"),
                         (["--pp", "2", "--micro-batches", "4", "--schedule-file", tmp_path / "none.csv"],
                          "cannot be read")):
        bad = estimate(*args)
        assert bad.returncode == 2 and needle in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


class _World:
    """A mesh's ranks in one process: allgather gives back ``values`` (each rank's), or, without them, this
    rank's value ``size`` times and keeps it (how the ranks' values are collected first)."""

    def __init__(self, size, values=None):
        self.size, self.values, self.kept = size, values, None
        self.mpi = self

    def allgather(self, mine):
        self.kept = mine
        return self.values or [mine] * self.size


def gathered(fn, per_rank, mesh, *extra):
    """``fn(pp_times, mesh, comm, *extra)`` as rank 0 computes it when every rank has its own ``per_rank``."""
    mines = []
    for times in per_rank:
        world = _World(len(per_rank))
        fn(times, mesh, world, *extra)
        mines.append(world.kept)
    return fn(per_rank[0], mesh, _World(len(per_rank), mines), *extra)


@pytest.mark.parametrize("name,m", [("1f1b", 8), ("zb-h1", 4), ("gpipe", 3)])
def test_replayed_bubble_is_the_simulators_on_each_actions_own_cost(name, m):
    """measure.replayed: each step simulated on its own actions' seconds. Timestamps made by the simulator itself
    (every action where it puts it, no gap) measure exactly the replayed bubble; equal costs replay the closed
    form; a slow action on one stage raises the replay above the simulator's on the median costs."""
    from zerompi.pipeline import measure
    p, s = 2, schedules.make(name, 2, m)

    def step_times(cost):
        sim = timeline.run(s, cost)
        return [[(a, t0, t0, t1) for a, t0, t1 in spans] for spans in sim.spans], sim

    equal, sim = step_times(timeline.unit_costs(s))
    uneven, sim2 = step_times(lambda a: 5.0 if (a.kind, a.mb, a.chunk) == ("B", 1, 1) else 1.0 + 0.1 * a.chunk)
    # each rank's kept steps (two pipeline groups): a first step (left out), the equal-cost one, the uneven one
    per_rank = [[equal[r % p], equal[r % p], uneven[r % p]] for r in range(2 * p)]
    mesh = SimpleNamespace(coords=lambda r: {"pp": r % p, "dp": r // p, "sp": 0, "tp": 0})
    replay = gathered(measure.replayed, per_rank, mesh, s)
    measured = gathered(measure.bubble, per_rank, mesh)
    assert replay == pytest.approx([closed_form(name, p, m, 1), sim2.bubble_fraction])
    assert measured == pytest.approx(replay)
    medians = timeline.run(s, lambda a: 1.0 + 0.1 * a.chunk).bubble_fraction
    assert replay[1] > medians + 0.05
