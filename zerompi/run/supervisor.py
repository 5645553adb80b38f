"""``python -m zerompi.run -n N [--max-restarts K] [--shrink] -- <train flags>``: a job that carries on after a failure.

The supervisor launches ``mpiexec -n N python -m zerompi.train <flags> --replicas JOB``, watches it (watch.py),
and when a rank dies (killed, its node gone) or the job ends non-zero (the watchdog's abort on a cut link), it
assembles the newest committed step from the replicas that survive (checkpoint/replica_files.py), relaunches on
the same N (or, with ``--shrink``, on the ranks left) resuming from it -- the checkpoint's own load, resharded to
the new world size -- and goes on. It gives up with one line when a shard has no surviving copy, after
``--max-restarts`` relaunches, or when too few ranks are left. Each failure is printed (what failed, when it was
detected, the step restored, steps lost, the recovery's detect / relaunch / restore seconds) and recorded in
``JOB/failures.json``, which the job completes and puts in its ``--metrics-json`` (``failures``). The step that
failed is the one after the most any rank had taken (the ranks' ``step``), so the steps lost (failed - restored)
count the one in flight and, with ``--replicas-commit behind``, the one whose commit was still under way.
"""
import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import sys
import time
from typing import List, Optional

from ..checkpoint.format import CheckpointError
from ..checkpoint.replica_files import assemble, clean, committed_step, job_dir
from ..comm.topology import node_size_env
from ..errors import ConfigError, check
from ..train.config import parse_config
from ..train.replicas import read_failures, write_failures
from . import watch

PROG = "zerompi.run"
DROPPED_ENV = ("ZEROMPI_FAULT", "ZEROMPI_CHECKPOINT_CRASH")   # test hooks: they fire in the first launch only


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def parse(argv: List[str]):
    """(options, the train flags); ConfigError (one line) on bad input."""
    p = _Parser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0],
                epilog="after --: the flags of python -m zerompi.train (docs/failures.md)")
    p.add_argument("-n", type=int, required=True, help="ranks to launch")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches before giving up (default 3)")
    p.add_argument("--shrink", action="store_true", help="relaunch on the ranks left (default: the same N)")
    p.add_argument("--launcher", default=None, metavar="CMD",
                   help="the launcher's command line, {n} for the ranks (default: mpiexec -n {n}); e.g. with "
                        "-hosts or a hostfile: the nodes are then MPI's")
    at = argv.index("--") if "--" in argv else len(argv)
    opts = p.parse_args(argv[:at])      # --help: printed, SystemExit(0)
    check(at < len(argv), "no train flags: use python -m zerompi.run -n N [--max-restarts K] [--shrink] -- "
                          "<python -m zerompi.train flags>")
    check(opts.launcher is None or "{n}" in opts.launcher,
          f"--launcher {opts.launcher!r} has no {{n}}; write where the number of ranks goes (mpiexec -n {{n}} ...)")
    check(opts.n >= 1, f"-n {opts.n} is not allowed; use a number of ranks >= 1")
    check(opts.max_restarts >= 0, f"--max-restarts {opts.max_restarts} is not allowed; use a whole number >= 0 "
                                  "of relaunches")
    return opts, argv[at + 1:]


def configure(opts, flags: List[str]):
    """(train flags with --replicas JOB, the job's name, its node size); ConfigError as the train CLI says it."""
    named = "run-" + hashlib.sha256(json.dumps([os.getcwd(), flags]).encode()).hexdigest()[:12]
    cfg = parse_config(["--replicas", named, *flags])    # the flags' own --replicas, given after, wins
    job = cfg.replicas
    if job == named:
        flags = flags + ["--replicas", job]
    node = cfg.mesh.node_size or node_size_env()
    check(node is not None or opts.launcher is not None,
          f"replicas={job!r} keeps each shard's second copy on another node, and no node size is given: on one "
          "host (one node), give --node-size K to the train flags to make nodes, or --launcher with the hosts")
    cfg.check_world(opts.n)                 # and the nodes: 2 or more (train/replicas.check_nodes)
    return cfg, flags, job, node


def mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if not found:
        raise ConfigError("mpiexec not found (next to this Python or on PATH): install an MPI")
    return found


def say(line: str) -> None:
    sys.stderr.write(f"{PROG}: {line}\n")
    sys.stderr.flush()


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, flags = parse(argv)
        cfg, flags, job, node = configure(opts, flags)
        launcher = mpiexec() if opts.launcher is None else None
    except ConfigError as e:
        say(f"error: {e}")
        return 2
    except SystemExit as e:             # --help
        return e.code or 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the finally below cleans up
    clean(job)                              # what a supervisor of this job that was killed left
    try:
        return _supervise(opts, cfg, flags, job, node, launcher)
    finally:
        clean(job)


def _supervise(opts, cfg, flags, job, node, launcher) -> int:
    n, restarts, resume, env = opts.n, 0, [], dict(os.environ)
    records: List[dict] = []
    shown = set()

    def show_recoveries() -> None:
        for k, r in enumerate(read_failures(job)):
            if k not in shown and r.get("restore_s") is not None:
                shown.add(k)
                say(f"recovered from failure {k + 1} in {r['recovery_s']:.2f} s: detect {r['detect_s']:.2f} + "
                    f"relaunch {r['relaunch_s']:.2f} + restore {r['restore_s']:.2f} s (restore: the ranks up to "
                    f"step {(r['restored_step'] or 0) + 1} done)")

    while True:
        start = shlex.split(opts.launcher.replace("{n}", str(n))) if opts.launcher else [launcher, "-n", str(n)]
        cmd = [*start, sys.executable, "-m", "zerompi.train", *flags, *resume]
        out = watch.attempt(cmd, env, job, show_recoveries)
        show_recoveries()
        if out.status == 0:
            lost = sum(r["steps_lost"] for r in records)
            if records:
                say(f"done: {len(records)} failure{'s' if len(records) > 1 else ''} recovered, {lost} step"
                    f"{'s' if lost != 1 else ''} lost in all")
            return 0
        if out.status == 2 and not out.dead:
            return 2                        # the job's own one-line configuration error
        committed = committed_step(job)
        last = max([r.get("step") or 0 for r in out.ranks.values()] + [committed or 0])
        failed_at = _failed_at(job, out) if out.started else out.detected_at
        who = ", ".join(f"rank {d['rank']} ({d['host']})" for d in sorted(out.dead, key=lambda d: d["rank"])) \
            or (f"the job (exit status {out.status})" if out.started else
                f"the launch (exit status {out.status}, no rank started)")
        if restarts >= opts.max_restarts:
            say(f"giving up: {who} failed at step {last + 1} after {restarts} relaunch"
                f"{'es' if restarts != 1 else ''} (--max-restarts {opts.max_restarts})")
            return 1
        left = n - len(out.dead) if opts.shrink else n
        try:
            if opts.shrink:
                cfg.check_world(left)
        except ConfigError as e:
            say(f"giving up: {who} failed at step {last + 1} and {left} ranks are left, too few: {e}")
            return 1
        if not out.started and committed is None:   # nothing ran, nothing committed: the first launch again
            restarts += 1
            _record(job, records, out, failed_at, [], last + 1, None, 0)
            say(f"{who} failed; launching it again from the start, relaunch {restarts} of at most "
                f"{opts.max_restarts}")
            continue
        try:
            step, folder = assemble(job)
        except CheckpointError as e:
            say(f"giving up: {who} failed at step {last + 1}: {e}")
            return 1
        restarts += 1
        record = _record(job, records, out, failed_at, sorted(out.dead, key=lambda d: d["rank"]), last + 1, step,
                         last + 1 - step if out.started else 0)     # a launch in which no rank started loses none
        stamp = time.strftime("%H:%M:%S", time.localtime(out.detected_at))
        say(f"{who} failed at step {last + 1}; detected at {stamp} ({record['detect_s']:.2f} s after); restoring "
            f"committed step {step} ({record['steps_lost']} step{'s' if record['steps_lost'] != 1 else ''} lost) "
            f"on {left} ranks, relaunch {restarts} of at most {opts.max_restarts}")
        n, resume = left, ["--resume", folder]
        env = {k: v for k, v in env.items() if k not in DROPPED_ENV}


def _record(job: str, records: List[dict], out, failed_at: float, dead: List[dict], failed: int,
            restored: Optional[int], lost: int) -> dict:
    """One failure's record (its recovery's seconds filled in by the job that goes on), kept in ``records`` and in
    ``JOB/failures.json``: ``dead`` the dead ranks' records in rank order (none where no rank started: ``started``
    is the outcome's)."""
    record = {"rank": dead[0]["rank"] if dead else None, "host": dead[0]["host"] if dead else None,
              "ranks": [d["rank"] for d in dead], "started": out.started, "failed_step": failed,
              "restored_step": restored, "steps_lost": lost,
              "detect_s": round(max(0.0, out.detected_at - failed_at), 3),
              "relaunch_s": None, "restore_s": None, "recovery_s": None, "detected_at": out.detected_at}
    records.append(record)
    write_failures(job, read_failures(job)[:len(records) - 1] + [record])
    return record


def _failed_at(job: str, out) -> float:
    """When the failure happened: what a killer recorded (``JOB/killed_at``, kill() below: then the ranks it
    killed are the dead ones, not those the launcher ended right after), else when the dead ranks were last seen
    committing a step (a bound: the detection is at most that late)."""
    path = os.path.join(job_dir(job), "killed_at")
    try:
        with open(path) as f:
            record = json.load(f)
        os.unlink(path)
        killed = [out.ranks[r] for r in record["ranks"] if r in out.ranks]
        out.dead = killed or out.dead
        return float(record["t"])
    except (OSError, ValueError, KeyError, TypeError):
        return max([d.get("t", out.detected_at) for d in out.dead] or [out.detected_at])


def kill(job: str, ranks: List[int], wipe_nodes: bool = False) -> List[int]:
    """Fault injection for tests and the soak: SIGKILL the job's ``ranks`` (recording when), and with
    ``wipe_nodes`` also remove their nodes' replica folders (a lost node). Returns the pids killed."""
    infos = watch.ranks_of(job)
    with open(os.path.join(job_dir(job), "killed_at"), "w") as f:
        json.dump({"t": time.time(), "ranks": list(ranks)}, f)
    pids = []
    for r in ranks:
        pids.append(infos[r]["pid"])
        os.kill(infos[r]["pid"], signal.SIGKILL)
    if wipe_nodes:
        for node in {infos[r]["node"] for r in ranks}:
            shutil.rmtree(os.path.join(job_dir(job), f"node{node:03d}"), ignore_errors=True)
    return pids
