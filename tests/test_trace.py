"""The timeline (--trace, ZeroConfig(trace=...); engine/trace.py).

The merged file must keep the Chrome trace-event format (what Perfetto and chrome://tracing
read): required keys, known ``ph`` values, non-negative durations, every launched collective
completed, every rank present, no two spans of one track overlapping. Its comm tracks must
agree with the engine's own timers step by step (within 5%), its clocks must be aligned (no
collective completes on one rank before another rank started it, even when the ranks'
clocks are 1000 s apart), and turning it on must not change a bit of the results.
"""
import json
import os
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from tests.mpirun import no_python_noise, run_mpi, run_train, zerompi_lines
from tests.test_overlap import FakeComm, mlp_layers
from zerompi import ZeroConfig, ZeroEngine
from zerompi.engine import trace as trace_mod
from zerompi.engine.phase import Phase
from zerompi.errors import ConfigError

PHASES = {"X", "B", "E", "M"}      # what the engine writes: complete spans, begin / end, metadata
EPS_US = 0.01                      # timestamps are rounded to 1 ns
SMALL3 = ["--model", "mlp", "--stage", "3", "--width", "64", "--depth", "4", "--batch", "12", "--bucket-mb", "0.01",
          "--micro-batches", "2"]
GPT1 = ["--model", "gpt", "--stage", "1", "--n-layer", "2", "--d-model", "32", "--seq-len", "16", "--batch", "6",
        "--eval-every", "3"]
STEPS, KEEP = 7, 3


def validate(trace: dict, ranks, complete: bool = True) -> dict:
    """Assert the trace-event rules; returns {(pid, tid): [(start µs, end µs, event)]}."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list), "not a trace-event object"
    events = trace["traceEvents"]
    by_track = defaultdict(list)
    for e in events:
        assert {"name", "ph", "pid"} <= e.keys(), e
        assert e["ph"] in PHASES, e
        if e["ph"] == "M":
            assert "args" in e, e
            continue
        assert {"ts", "tid", "cat"} <= e.keys(), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        by_track[(e["pid"], e["tid"])].append(e)
    tracks = defaultdict(list)
    for key, evs in by_track.items():
        open_ = []
        for e in sorted(evs, key=lambda e: e["ts"]):          # stable: a B stays before its E at equal ts
            if e["ph"] == "X":
                tracks[key].append((e["ts"], e["ts"] + e["dur"], e))
            elif e["ph"] == "B":
                open_.append(e)
            else:
                assert open_, f"an E without its B on {key}: {e}"
                b = open_.pop()
                assert b["name"] == e["name"] and e["ts"] >= b["ts"], (b, e)
                tracks[key].append((b["ts"], e["ts"], b))
        assert not (complete and open_), f"launched, never completed on {key}: {open_}"
    assert {e["pid"] for e in events} == set(ranks)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in ranks}
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], s[1]))
        for (_, a1, a), (b0, _, b) in zip(spans, spans[1:]):
            assert b0 >= a1 - EPS_US, f"spans overlap on track {key}: {a} and {b}"
    return tracks


def union_us(spans, lo: float, hi: float) -> float:
    """µs of [lo, hi] covered by at least one of the (start, end) spans."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b, *_ in spans if b > lo and a < hi):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def comm_spans(tracks, pid):
    return [s for (p, tid), spans in tracks.items() if p == pid and tid >= trace_mod.LANE0 for s in spans]


# ---- one CLI run per configuration, traced; the same run untraced for the bits ------------------
@pytest.fixture(scope="module", params=["stage3-mlp", "stage1-gpt"])
def traced(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    flags = (SMALL3 if request.param == "stage3-mlp" else GPT1) + ["--steps", STEPS]
    ranks = 3 if request.param == "stage3-mlp" else 2
    path = tmp / "trace.json"
    metrics = run_train(ranks, tmp, *flags, "--trace", path, "--trace-steps", KEEP, timeout=180, tag="traced")
    plain = run_train(ranks, tmp, *flags, timeout=180, tag="plain")
    return SimpleNamespace(trace=json.loads(path.read_text()), metrics=metrics, plain=plain, ranks=ranks,
                           name=request.param)


def test_trace_keeps_the_trace_event_format(traced):
    validate(traced.trace, range(traced.ranks))
    assert traced.trace["displayTimeUnit"] == "ms"
    assert traced.trace["otherData"]["zerompi"]["ranks"] == traced.ranks


def test_trace_holds_the_last_steps_and_every_track(traced):
    tracks = validate(traced.trace, range(traced.ranks))
    for r in range(traced.ranks):
        steps = [s[2] for s in tracks[(r, trace_mod.STEP)]]
        assert [e["name"] for e in steps] == [f"step {k}" for k in range(STEPS - KEEP + 1, STEPS + 1)]
        compute = {s[2]["name"] for s in tracks[(r, trace_mod.COMPUTE)]}
        layers = {n.split(" ", 1)[1] for n in compute if n.startswith("forward ")}
        assert layers and layers == {n.split(" ", 1)[1] for n in compute if n.startswith("backward ")}, compute
        buckets = {int(n.rsplit("b", 1)[1]) for n in compute if n.startswith("optimizer b")}
        assert buckets, compute
        assert {f"local sum b{b}" for b in buckets} <= compute, compute
        comm = [s[2] for s in comm_spans(tracks, r)]
        rs = [e for e in comm if e["args"]["op"] == "reduce_scatter"]
        assert {e["args"]["bucket"] for e in rs} == buckets
        assert all(e["args"]["bytes"] > 0 and e["args"]["step"] >= STEPS - KEEP for e in rs)
        assert any(e["args"]["op"] == "all_gather" for e in comm)
        assert any(e["name"] == "gather_scalars" for e in comm)
        waits = {s[2]["name"] for s in tracks[(r, trace_mod.WAIT)]}
        # The training thread blocked in MPI: starts, and tests or waits (which of the two depends on when
        # the library completes a collective: under Open MPI a step may see every one done at a test).
        assert "start" in waits and any(w.startswith("wait ") or w == "test" for w in waits), waits
    if traced.name == "stage3-mlp":     # stage 3 prefetches: collectives overlap, on more than one lane
        assert any(tid > trace_mod.LANE0 for (_, tid) in tracks), sorted(tracks)


def test_comm_in_flight_agrees_with_the_engine_timers(traced):
    """Per step and rank: the union of the comm spans over the step's window against the engine's
    comm_busy over the same window (the step span's args), within 5%; the wait track likewise."""
    tracks = validate(traced.trace, range(traced.ranks))
    checked = 0
    for r in range(traced.ranks):
        comm, waits = comm_spans(tracks, r), tracks[(r, trace_mod.WAIT)]
        for lo, hi, step in tracks[(r, trace_mod.STEP)]:
            busy, wait = step["args"]["timers_comm_busy_ms"] * 1e3, step["args"]["timers_comm_wait_ms"] * 1e3
            assert busy > 0, step
            assert abs(union_us(comm, lo, hi) - busy) <= 0.05 * busy, (step, union_us(comm, lo, hi))
            assert abs(union_us(waits, lo, hi) - wait) <= 0.05 * wait, (step, union_us(waits, lo, hi))
            checked += 1
    assert checked == KEEP * traced.ranks


def test_tracing_changes_no_bit(traced):
    assert traced.metrics["final_params_sha256"] == traced.plain["final_params_sha256"]
    assert traced.metrics["losses"] == traced.plain["losses"]


def test_metrics_have_the_breakdown_of_every_step(traced):
    parts = traced.metrics["step_breakdown_s"]
    assert set(parts) == {"forward", "backward", "optimizer", "comm_wait", "comm_busy", "other"}
    assert all(len(v) == STEPS for v in parts.values())
    assert np.median(parts["forward"]) == pytest.approx(traced.metrics["time_breakdown_s"]["forward"])


# ---- clocks, crashes, input -----------------------------------------------------------
def test_clocks_are_aligned_across_ranks(tmp_path):
    """Every rank's clock 1000 s from the next: after the alignment, for every collective, the
    last rank to start it started before the first rank to see it complete."""
    path = tmp_path / "trace.json"
    run_mpi(3, ["tests/drivers/trace_skew.py", tmp_path / "p.npz", "--stage", "3", "--width", "32", "--depth", "3",
                "--batch", "12", "--bucket-mb", "0.002", "--steps", "3", "--trace", path], timeout=180)
    trace = json.loads(path.read_text())
    tracks = validate(trace, range(3))
    clock = trace["otherData"]["zerompi"]["clock"]
    slack = max(c["round_trip_us"] for c in clock) / 2 + 50
    for c in clock:                          # the offsets undo the skew
        assert abs(c["clock_offset_us"] + 1e9 * c["rank"]) <= slack, clock
    seen = defaultdict(list)                  # (op, bucket, step, n-th) -> [(start, end)] of every rank
    for r in range(3):
        count = defaultdict(int)
        for start, end, e in sorted(comm_spans(tracks, r), key=lambda s: s[0]):
            key = (e["args"]["op"], e["args"]["bucket"], e["args"]["step"])
            count[key] += 1
            seen[key + (count[key],)].append((start, end))
    assert len(seen) > 10
    for key, spans in seen.items():
        assert len(spans) == 3, key
        assert max(s for s, _ in spans) <= min(e for _, e in spans) + slack, (key, spans)


def test_a_crash_keeps_what_there_is(tmp_path):
    """raise on rank 1: rank 1 writes its own events (trace.rank1.json) before the abort."""
    path = tmp_path / "trace.json"
    proc = run_mpi(2, ["-m", "zerompi.train", *SMALL3, "--steps", "6", "--trace", path], timeout=120, check=False,
                   env={"ZEROMPI_FAULT": "raise@rank1:step3"})
    assert proc.returncode != 0
    own = tmp_path / "trace.rank1.json"
    assert own.exists(), proc.stderr
    assert "the trace so far is in" in proc.stderr
    tracks = validate(json.loads(own.read_text()), [1], complete=False)
    steps = [s[2]["name"] for s in tracks[(1, trace_mod.STEP)]]
    assert steps == ["step 1", "step 2", "step 3 (did not end)"], steps


def test_a_timeout_keeps_what_there_is(tmp_path):
    """hang on rank 1: rank 0's watchdog fires, and rank 0 writes its events to the file itself."""
    path = tmp_path / "trace.json"
    proc = run_mpi(2, ["-m", "zerompi.train", *SMALL3, "--steps", "6", "--trace", path, "--timeout-s", "3"],
                   timeout=120, check=False, env={"ZEROMPI_FAULT": "hang@rank1:step2"})
    assert proc.returncode != 0 and "collective timeout" in proc.stderr
    tracks = validate(json.loads(path.read_text()), [0], complete=False)
    assert [s[2]["name"] for s in tracks[(0, trace_mod.STEP)]][0] == "step 1"


def test_an_error_on_every_rank_still_merges(tmp_path):
    """A non-finite fp32 gradient stops every rank together: the file has both ranks' steps."""
    path = tmp_path / "trace.json"
    proc = run_mpi(2, ["-m", "zerompi.train", *SMALL3, "--dtype", "fp32", "--steps", "6", "--trace", path],
                   timeout=120, check=False, env={"ZEROMPI_FAULT": "nan@rank1:step3"})
    assert proc.returncode == 1 and "non-finite" in proc.stderr, proc.stderr
    tracks = validate(json.loads(path.read_text()), range(2))
    for r in range(2):
        assert [s[2]["name"] for s in tracks[(r, trace_mod.STEP)]][:2] == ["step 1", "step 2"]


@pytest.mark.parametrize("flags, needle", [
    (["--trace-steps", "0"], "trace_steps=0 must be an integer >= 1"),
    (["--trace", "no-such-folder/t.json"], "trace='no-such-folder/t.json'"),
    (["--trace", ""], "trace=''"),
])
def test_bad_trace_flags_exit_2_with_one_line(flags, needle):
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--steps", "1"] + flags, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = zerompi_lines(proc.stderr)     # zerompi's own lines: a launcher may add its banner
    no_python_noise(proc.stderr)
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_config_validates_the_trace_fields():
    assert ZeroConfig().trace is None and ZeroConfig().trace_steps >= 1
    with pytest.raises(ConfigError, match="trace=3"):
        ZeroConfig(trace=3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="trace_steps="):
            ZeroConfig(trace_steps=bad)


# ---- in one process: every stage's hooks, and the compute track's stack -----------------------
def one_step(eng, n=5):
    eng.begin_forward()
    for i in range(n):
        with eng.unsharded(i):
            pass
    eng.begin_backward()
    for i in reversed(range(n)):
        with eng.unsharded(i):
            pass
        eng.grads_ready(i, {f"w{i}": np.full((4, 4), 0.01, np.float32)})
    eng.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_traces_in_one_process(stage, tmp_path):
    path = tmp_path / "t.json"
    off = ZeroEngine(mlp_layers(), ZeroConfig(stage=stage, dtype="fp32", bucket_mb=1e-5), FakeComm(3))
    assert off.trace is None and off.timers.trace is None and off.inflight.trace is None
    eng = ZeroEngine(mlp_layers(), ZeroConfig(stage=stage, dtype="fp32", bucket_mb=1e-5, trace=str(path),
                                              trace_steps=2), FakeComm(3))
    for _ in range(3):
        one_step(eng)
        one_step(off)
    np.testing.assert_array_equal(off.optimizer.master, eng.optimizer.master)       # no bit moved
    eng.close()
    assert eng.timers.trace is None and eng.gatherer.trace is None      # unhooked at close
    tracks = validate(json.loads(path.read_text()), [0])
    assert [s[2]["name"] for s in tracks[(0, trace_mod.STEP)]] == ["step 2", "step 3"]
    names = [s[2]["name"] for s in tracks[(0, trace_mod.COMPUTE)]]
    assert {f"forward l{i}" for i in range(5)} <= set(names) and {f"backward l{i}" for i in range(5)} <= set(names)
    want = {"optimizer (whole model)"} if stage == 0 else {f"optimizer b{b}" for b in range(5)}
    assert want <= set(names), names
    off.close()


class FakeTimers:
    def now(self):
        return trace_mod.CLOCK()

    def busy_total(self, now):
        return 0.0

    def wait_total(self):
        return 0.0


def test_the_compute_track_never_overlaps(tmp_path, monkeypatch):
    """A layer held through others (the GPT's embedding), released out of order, and a local sum
    run while a layer is held: the spans tile, paused where the engine runs."""
    now = iter(range(1000))
    monkeypatch.setattr(trace_mod, "CLOCK", lambda: float(next(now)))
    layout = SimpleNamespace(buckets=[], layer_names=["a", "b", "c"])
    tr = trace_mod.Tracer(str(tmp_path / "t.json"), 2, SimpleNamespace(rank=0, size=1, stats={}), FakeTimers(), layout)
    tr.phase(Phase.FORWARD)
    tr.pause(); tr.hold(0, Phase.FORWARD)          # noqa: E702  unshard(0)
    tr.pause(); tr.hold(1, Phase.FORWARD)          # noqa: E702  unshard(1) while 0 is held
    tr.push("local sum b0", {})                    # inside grads_ready, 1 held
    tr.pop()
    tr.release(0); tr.resume()                     # noqa: E702  out of order: 0 first
    tr.release(1); tr.resume()                     # noqa: E702
    tr.step_done(1)
    tr.write()
    tracks = validate(json.loads((tmp_path / "t.json").read_text()), [0])
    names = [s[2]["name"] for s in tracks[(0, trace_mod.COMPUTE)]]
    # b computes before the sum, after it until reshard(0) enters the engine, and after that until reshard(1)
    assert names == ["forward a", "forward b", "local sum b0", "forward b", "forward b"], names


def test_crash_path_names_the_rank():
    assert trace_mod.crash_path("out/t.json", 0) == "out/t.json"
    assert trace_mod.crash_path("out/t.json", 3) == "out/t.rank3.json"
    assert trace_mod.crash_path("t", 2) == "t.rank2.json"
    assert os.path.basename(trace_mod.crash_path("a.b/trace.json", 1)) == "trace.rank1.json"
