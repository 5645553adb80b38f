"""Communication behind compute (issue 6): the schedule, its bound on gathered buckets, its
timers, and that overlap never moves a bit.

Multi-rank runs go through the train CLI (tests/drivers/train_many.py, one launch per
world size); the scheduling itself is checked in-process against a one-rank fake MPI whose
collectives complete only after a set number of tests -- like real non-blocking MPI, they
move only when the rank calls in -- so "what is in flight when" is deterministic.
"""
import json

import numpy as np
import pytest
from mpi4py import MPI

from tests.mpirun import one_line, run_mpi
from tests.reference import train_reference
from zerompi import BucketState, ConfigError, ZeroConfig, ZeroEngine
from zerompi.comm.communicator import Communicator
from zerompi.optim.reference import sum_rows_reference
from zerompi.engine.phase import Phase, infer_phase, prefetch_window, visits_after
from zerompi.engine.timers import StepTimers, hidden_fraction, summarize

# Width 64 at --bucket-mb 0.01 puts each layer in its own bucket (fp16 and fp32): 5 buckets.
W, D, STEPS = 64, 5, 3
BASE = ["--model", "mlp", "--width", str(W), "--depth", str(D), "--steps", str(STEPS), "--batch", "12",
        "--lr", "1e-2", "--bucket-mb", "0.01"]
SERIAL = ["--stage", "0", "--no-overlap"]          # the reference every variant must equal bit for bit
VARIANTS = [SERIAL, ["--stage", "1"], ["--stage", "2"], ["--stage", "2", "--no-overlap"],
            ["--stage", "3", "--prefetch", "0"], ["--stage", "3", "--prefetch", "1"],
            ["--stage", "3", "--prefetch", "2"], ["--stage", "3", "--no-overlap"],
            ["--stage", "3", "--prefetch", "2", "--comm-progress", "thread"]]
# (world size, dtype, micro-batches): one launch each, about 3 s.
COMBOS = [(n, d, m) for n in (2, 3) for d in ("fp16", "fp32") for m in (1, 2)]


def run_variants(n, dtype, micro):
    configs = [BASE + ["--dtype", dtype, "--micro-batches", str(micro)] + v for v in VARIANTS]
    proc = run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=240)
    runs = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(runs) == len(VARIANTS), proc.stdout
    return runs


@pytest.fixture(scope="module", params=COMBOS, ids=lambda c: f"N{c[0]}-{c[1]}-mb{c[2]}")
def variants(request):
    return request.param, run_variants(*request.param)


def test_overlap_and_prefetch_do_not_move_a_bit(variants):
    _, runs = variants
    want = runs[0]["final_params_sha256"]
    for v, m in zip(VARIANTS, runs):
        assert m["final_params_sha256"] == want, v
        assert m["losses"] == runs[0]["losses"], v


def test_gathered_buckets_never_exceed_one_plus_prefetch(variants):
    _, runs = variants
    for v, m in zip(VARIANTS, runs):
        stage = int(v[1])
        if stage < 3:
            assert m["peak_gathered_buckets"] == 0, v
            continue
        depth = 0 if "--no-overlap" in v else int(v[v.index("--prefetch") + 1]) if "--prefetch" in v else 1
        # 5 buckets > 1 + depth, so the window is full at the first layer: the bound is reached, not just kept.
        assert m["peak_gathered_buckets"] == 1 + depth, v


def test_time_breakdown_in_metrics(variants):
    _, runs = variants
    for v, m in zip(VARIANTS, runs):
        tb = m["time_breakdown_s"]
        assert set(tb) == {"forward", "backward", "optimizer", "comm_wait", "comm_busy", "other"}, v
        assert all(x >= 0 for x in tb.values()), (v, tb)
        assert tb["forward"] > 0 and tb["backward"] > 0 and tb["optimizer"] > 0, (v, tb)
        assert 0.0 <= m["comm_hidden_fraction"] <= 1.0, v
        assert len(m["step_times_s"]) == STEPS


def test_prefetch_matches_float64_reference(tmp_path):
    """Stage 3 with deep prefetch and two micro-batches on 3 ranks against the float64 oracle."""
    out = tmp_path / "p.npz"
    run_mpi(3, ["tests/drivers/mlp_params.py", out, "--stage", "3", "--dtype", "fp32", "--width", "32",
                "--depth", "4", "--batch", "24", "--steps", "4", "--lr", "1e-2", "--bucket-mb", "0.004",
                "--prefetch", "2", "--micro-batches", "2"], timeout=120)
    got = np.load(out)
    ref_losses, ref = train_reference(32, 4, 0, 4, 24, 1e-2)
    _, init = train_reference(32, 4, 0, 0, 24, 1e-2)
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-6)
    for name, want in ref.items():
        moved = np.linalg.norm(want - init[name])
        assert moved > 0 and np.linalg.norm(got[name] - want) / moved < 1e-5, name


@pytest.mark.every_mpi
@pytest.mark.parametrize("flags,needle", [(["--prefetch", "-1"], "prefetch=-1"),
                                          (["--comm-progress", "poll"], "progress='poll'")])
def test_bad_overlap_flags_exit_2(flags, needle):
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", "mlp"] + flags, timeout=60, check=False)
    one_line(proc, 2, needle)


def test_config_validates_overlap_fields():
    for bad in (dict(prefetch=-1), dict(prefetch=1.5), dict(prefetch=True), dict(progress="spin"),
                dict(overlap="yes")):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ZeroConfig(**bad)
    assert ZeroConfig().prefetch == 1 and ZeroConfig().overlap and ZeroConfig().progress == "test"


# ---- the schedule, in-process against a fake one-rank MPI ------------------------------
class FakeHandle:
    """A collective that completes at its ``latency``-th test (or at wait), then runs its local part."""

    def __init__(self, op, finish, latency):
        self.op, self.tag = op, None
        self.finish, self.latency, self.tests, self.done = finish, latency, 0, False

    def test(self):
        self.tests += 1
        return self.done or self.tests >= self.latency

    def wait(self):
        if not self.done:
            self.done = True
            if self.finish:
                self.finish()


class FakeMPI:
    """One rank, for the few direct MPI calls (sizes, the master gather)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Allgather(self, send, recv):
        if send is not MPI.IN_PLACE:
            np.asarray(recv).reshape(-1)[:] = np.asarray(send).reshape(-1)


class FakeComm(Communicator):
    """The engine's collectives on one rank, logged, each in flight for ``latency`` tests
    (the default, 100, is more than the progress calls of a step: only a wait completes it)."""

    def __init__(self, latency):
        super().__init__(FakeMPI())
        self.latency = latency   # tests until a non-blocking collective completes
        self.started = []        # "reduce_scatter" / "all_gather", in start order

    def ireduce_scatter(self, send, out, scale=1.0, accumulate=False, tag=None, quant=None):
        self.started.append("reduce_scatter")
        rows = send.reshape(1, -1).copy()
        return FakeHandle("reduce_scatter", lambda: sum_rows_reference(rows, out, scale, accumulate), self.latency)

    def iall_gather(self, buf, tag=None, logical_block=None, sig=None):
        self.started.append("all_gather")
        return FakeHandle("all_gather", None, self.latency)


def mlp_layers(n=5, width=4):
    rng = np.random.default_rng(1)
    return [(f"l{i}", {f"w{i}": rng.standard_normal((width, width)).astype(np.float32)}) for i in range(n)]


def make_engine(stage, latency=100, **kw):
    cfg = ZeroConfig(stage=stage, dtype="fp32", bucket_mb=1e-5, **kw)   # one layer per bucket
    fake = FakeComm(latency)
    eng = ZeroEngine(mlp_layers(), cfg, fake)
    assert len(eng.layout.buckets) == 5
    fake.started.clear()                     # the initial publish is not part of any step
    return eng, fake


def alive(eng):
    return sorted(eng.gatherer.gathered)


def one_micro_batch(eng, hints=True, on_unshard=None):
    n = eng.layout.num_layers
    if hints:
        eng.begin_forward()
    for i in range(n):
        with eng.unsharded(i):
            if on_unshard:
                on_unshard("fwd", i)
    if hints:
        eng.begin_backward()
    for i in reversed(range(n)):
        with eng.unsharded(i):
            if on_unshard:
                on_unshard("bwd", i)
        eng.grads_ready(i, {f"w{i}": np.full((4, 4), 0.01 * (i + 1), np.float32)})


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("hints", [True, False])
def test_stage3_prefetches_the_next_buckets_in_visit_order(depth, hints):
    eng, fake = make_engine(3, prefetch=depth)
    seen = []

    def check(direction, i):
        nxt = i + 1 if direction == "fwd" else i - 1
        assert eng.gatherer.state[i] is BucketState.UNSHARDED
        assert len(eng.gatherer.gathered) <= 1 + depth
        if depth and 0 <= nxt < 5:
            assert nxt in eng.gatherer.gathered, (direction, i, alive(eng))   # already on its way
        seen.append(len(eng.gatherer.gathered))

    for _ in range(2):
        one_micro_batch(eng, hints, check)
        eng.step()
        assert alive(eng) == list(range(depth + 1 if depth else 0))   # the next forward's first window
    assert max(seen) == 1 + depth == eng.gatherer.peak_gathered_buckets
    eng.close()


def test_stage3_keeps_the_turn_and_regathers_only_what_it_dropped():
    eng, fake = make_engine(3, prefetch=1)
    one_micro_batch(eng)
    # forward: 5 gathers; backward: the window at the turn kept buckets 4 and 3, so 3 more.
    assert fake.started.count("all_gather") == 5 + 3
    eng.close()


def test_stage3_carries_the_window_into_the_next_micro_batch():
    eng, fake = make_engine(3, prefetch=1, micro_batches=2)
    one_micro_batch(eng)
    first = fake.started.count("all_gather")
    one_micro_batch(eng)
    # The backward ended holding buckets 0 and 1 for the next forward: only 2, 3, 4 are
    # gathered again in it, then 2, 1, 0 in the backward (the turn keeps 4 and 3).
    assert (first, fake.started.count("all_gather") - first) == (8, 6)
    eng.step()
    assert alive(eng) == [0, 1] and fake.started.count("all_gather") == 16
    eng.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_bucket_buffers_are_reused_across_steps(stage):
    # A fresh bucket-sized array is paged in (zeroed by the kernel) on first touch; the
    # engine reuses released gather and staging buffers instead (collectives finish in 3 tests).
    eng, fake = make_engine(stage, latency=3, prefetch=1)
    allocated = []
    alloc = eng.ledger.alloc
    eng.ledger.alloc = lambda category, *a, **k: (allocated.append(category), alloc(category, *a, **k))[1]
    per_step = []
    for _ in range(3):
        before = len(allocated)
        one_micro_batch(eng)
        eng.step()
        per_step.append(len(allocated) - before)
    assert per_step[0] > 0 and per_step[1:] == [0, 0]
    eng.close()


def test_stage12_publish_is_complete_when_step_returns():
    for stage in (1, 2):
        eng, fake = make_engine(stage)
        one_micro_batch(eng)
        eng.step()
        assert fake.started.count("all_gather") == 5
        assert all(s is BucketState.UNSHARDED for s in eng.gatherer.state) and not eng.inflight
        eng.close()


def test_stage12_lazy_publish_waits_only_for_the_bucket_read():
    for stage in (1, 2):
        eng, fake = make_engine(stage, lazy_publish=True)
        one_micro_batch(eng)
        eng.step()
        assert all(s is BucketState.GATHERING for s in eng.gatherer.state)     # all five started, none waited
        eng.begin_forward()
        with eng.unsharded(0):
            assert eng.gatherer.state[0] is BucketState.UNSHARDED
            assert all(s is BucketState.GATHERING for s in eng.gatherer.state[1:])
        eng.params(3)
        assert eng.gatherer.state[3] is BucketState.UNSHARDED and eng.gatherer.state[4] is BucketState.GATHERING
        eng.full_parameters()                                             # waits for everything first
        assert all(s is BucketState.UNSHARDED for s in eng.gatherer.state)
        eng.close()


def test_reduction_starts_when_its_bucket_is_complete():
    eng, fake = make_engine(2)
    eng.begin_forward()
    for i in range(5):
        with eng.unsharded(i):
            pass
    eng.begin_backward()
    eng.grads_ready(4, {"w4": np.ones((4, 4), np.float32)})
    assert list(eng.reducer.handles) == [4] and fake.started == ["reduce_scatter"]   # before layer 3's backward
    eng.close()


@pytest.mark.parametrize("overlap,in_flight", [(True, 1), (False, 0)])
def test_progress_calls_move_reductions_during_the_backward(overlap, in_flight):
    # Each collective needs 3 tests; the engine tests at every unshard, reshard and grads_ready,
    # so with overlap on, every reduction but the last finishes during the backward unwaited.
    eng, fake = make_engine(2, latency=3, overlap=overlap)
    one_micro_batch(eng)
    assert fake.started.count("reduce_scatter") == 5
    assert len(eng.reducer.handles) == in_flight
    eng.step()
    eng.close()


# ---- the pieces, by themselves ---------------------------------------------------
def test_visits_and_window():
    assert list(visits_after(1, Phase.FORWARD, 3, False)) == [2, 2, 1, 0]
    assert list(visits_after(1, Phase.BACKWARD, 3, False)) == [0]
    assert list(visits_after(0, Phase.BACKWARD, 3, True)) == [0, 1, 2]
    lb = [0, 0, 1, 2, 2]     # buckets of five layers
    assert prefetch_window(0, visits_after(0, Phase.FORWARD, 5, False), lb, 1) == [0, 1]
    assert prefetch_window(4, visits_after(4, Phase.FORWARD, 5, False), lb, 2) == [2, 1, 0]
    assert prefetch_window(2, visits_after(2, Phase.BACKWARD, 5, False), lb, 5) == [1, 0]
    assert prefetch_window(None, iter(range(5)), lb, 2) == [0, 1]
    assert prefetch_window(3, iter([]), lb, 0) == [2]
    assert infer_phase(Phase.IDLE, 3, 0) is Phase.FORWARD
    assert infer_phase(Phase.FORWARD, 3, 3) is Phase.FORWARD
    assert infer_phase(Phase.FORWARD, 3, 2) is Phase.BACKWARD
    assert infer_phase(Phase.BACKWARD, 0, 1) is Phase.FORWARD


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_timers_split_phases_from_exposed_communication():
    clock = FakeClock()
    tm = StepTimers(clock)
    tm.enter(Phase.FORWARD)
    tm.comm_started()                   # t=0: a gather starts
    clock.t = 1.0
    with tm.exposed():                  # 1..1.5: waiting for it
        clock.t = 1.5
    tm.comm_completed()                 # busy 0..1.5
    clock.t = 3.0
    tm.enter(Phase.BACKWARD)            # forward: 3.0 - 0.5 exposed
    tm.comm_started()                   # 3.0: a reduction starts, finishes unseen behind compute
    clock.t = 5.0
    tm.comm_completed()                 # busy 3..5, nothing exposed
    tm.enter(Phase.OPTIMIZER)
    with tm.blocking():                 # 5..5.25: a blocking all-reduce
        clock.t = 5.25
    clock.t = 6.0
    tm.enter(Phase.IDLE)
    clock.t = 7.0                       # idle time is charged to nothing
    got = tm.take()
    assert got == {"forward": 2.5, "backward": 2.0, "optimizer": 0.75, "comm_wait": 0.75, "comm_busy": 3.75}
    assert hidden_fraction(got["comm_busy"], got["comm_wait"]) == pytest.approx(0.8)
    assert tm.take() == dict.fromkeys(got, 0.0)          # take() resets
    parts, frac = summarize([got, got], [8.0, 8.0])
    assert parts["other"] == pytest.approx(8.0 - 6.0) and frac == pytest.approx(0.8)


def test_timers_split_an_open_interval_at_take():
    clock = FakeClock()
    tm = StepTimers(clock)
    tm.enter(Phase.FORWARD)
    tm.comm_started()
    clock.t = 2.0
    first = tm.take()
    clock.t = 3.0
    tm.comm_completed()
    second = tm.take()
    assert (first["forward"], first["comm_busy"]) == (2.0, 2.0)
    assert (second["forward"], second["comm_busy"]) == (1.0, 1.0)
