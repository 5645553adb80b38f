"""The built-in models against their GEMM floor, measured in the same run (JSON lines to stdout).

    python scripts/bench_floor.py                         # the three models, N = 1, 2, 4, stages 0-3
    python scripts/bench_floor.py --models gpt-6x256 --ranks 2 --stages 0 --rounds 5
    python scripts/bench_floor.py --markdown              # also the README's table (on stderr)
    python scripts/bench_floor.py --device gpu --ranks 1,2 --no-cli   # on a GPU (CuPy): the same parts

For each model (the default GPT, the 6 x 256 GPT, the MLP 1024 x 8) and world size N, one
``mpiexec -n N`` job measures, on every rank at once, in turn and ``--repeats`` times:

- **floor**: the step's matrix multiplies alone -- the same shapes, as many of them, on
  the same BLAS (NumPy's matmul into preallocated float32 arrays) -- for the rank's share
  of the global batch (the GEMM floor);
- **fwd_bwd**: the model's forward and backward on those rows without the engine
  (models.gpt_chunk.run_micro_batch / train.loop.run_micro_batch on a stand-in that holds the
  parameters and drops the gradients);
- **data**: building the rank's rows of one step (the MLP's teacher, the GPT's corpus);
- **stage s**: one training step of an engine of each stage, as the train CLI makes it
  (train/run.py: the rank's rows, forward, backward, optimizer step, the loss summed over
  ranks), with the engine's time breakdown; ``other`` is the step time outside forward,
  backward, optimizer and waiting.

Each part starts after a barrier and counts for the slowest rank; a ratio to the floor is
taken within one repeat (the same moment, the same processes), then the median. With the
CLI runs (default; ``--no-cli`` skips them) every stage also runs as ``mpiexec -n N python
-m zerompi.train ... --metrics-json``: its median step (the first left out), its ``other``
share, and whether the stages' final parameters are bit-identical. Every job runs
``--rounds`` times, each round in a fresh random order (load from other jobs then hits every
configuration alike); medians over all. One record per (model, N).

``--device gpu``: every array on the rank's GPU (CuPy; ranks share it as the train CLI places
them), the floor's matrix multiplies through CuPy's matmul, and every part timed to the end
of the GPU's work (the device synchronized before the clock stops).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from launch import mpiexec  # noqa: E402  (one launcher and environment for every script)

MODELS = {   # name: train CLI flags (the global batch included)
    "gpt-default": ["--model", "gpt"],
    "gpt-6x256": ["--model", "gpt", "--n-layer", "6", "--d-model", "256", "--n-head", "4", "--seq-len", "128",
                  "--batch", "16"],
    "mlp-1024x8": ["--model", "mlp", "--width", "1024", "--depth", "8", "--batch", "64"],
}


# ---- the worker: floor, forward + backward and data on this rank's rows -----------------------
class StandIn:
    """The engine API that models' drivers call, without an engine: parameters held as they are
    built, gradients dropped (the engine's copy of them is engine time, not model time)."""

    loss_scale = 1.0

    def __init__(self, layers):
        self._params = [p for _, p in layers]
        self.layout = type("Layout", (), {"num_layers": len(layers)})()

    def begin_forward(self):
        pass

    def begin_backward(self):
        pass

    @contextmanager
    def unsharded(self, i):
        yield self._params[i]

    def grads_ready(self, i, grads):
        pass


def gpt_gemms(model, rows: int):
    """(a shape, b shape, transpose a, transpose b, stacked count) of every matrix multiply of a GPT step
    (the embedding's backward, a scatter-add, is not one)."""
    B, T, C, H, V = rows, model.seq_len, model.d_model, model.n_head, model.vocab
    n, hd = B * T, C // H
    out = []
    # qkv, proj, fc, out: y = x w, dx = dy w^T, dw = x^T dy
    for k, m in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):
        out += [((n, k), (k, m), False, False, 1), ((n, m), (m, k), False, True, 1), ((k, n), (n, m), True, False, 1)]
    bh = B * H
    out += [((T, hd), (hd, T), False, True, bh), ((T, T), (T, hd), False, False, bh),   # scores, att v
            ((T, T), (T, hd), True, False, bh), ((T, hd), (hd, T), False, True, bh),    # d v, d att
            ((T, T), (T, hd), False, False, bh), ((T, T), (T, hd), True, False, bh)]    # d q, d k
    out = out * model.n_layer
    out += [((n, C), (C, V), False, True, 1), ((n, V), (V, C), False, False, 1), ((V, n), (n, C), True, False, 1)]
    return out


def mlp_gemms(cfg, rows: int):
    """The MLP step's: y = x w and dw = x^T dz per layer, dx = dz w^T but for the first."""
    w = cfg.width
    fwd = [((rows, w), (w, w), False, False, 1)] * cfg.depth
    return (fwd + [((w, rows), (rows, w), True, False, 1)] * cfg.depth
            + [((rows, w), (w, w), False, True, 1)] * (cfg.depth - 1))


def floor_fn(gemms, xp=np):
    """A function running the matrix multiplies: float32 operands (transposed ones as views), outputs
    preallocated, on ``xp`` (NumPy, or CuPy on a GPU)."""
    rng = np.random.default_rng(0)
    calls = []
    for sa, sb, ta, tb, count in gemms:
        mk = lambda s, t: xp.asarray(rng.standard_normal((count,) + (s[::-1] if t else s)).astype(np.float32))
        a, b = mk(sa, ta), mk(sb, tb)
        a, b = (a.swapaxes(-1, -2) if ta else a), (b.swapaxes(-1, -2) if tb else b)
        if count == 1:
            a, b = a[0], b[0]
        calls.append((a, b, xp.empty(a.shape[:-1] + b.shape[-1:], np.float32)))

    def run():
        for a, b, o in calls:
            xp.matmul(a, b, out=o)
    return run


def placed(device: str, comm):
    """(array module, placement, the engine's communicator, a function that waits for the device)."""
    from zerompi.comm.communicator import Communicator
    from zerompi.comm.device import place
    from zerompi.comm.staging import device_communicator
    placement = place(device, comm)
    xp = placement.xp
    if xp is np:
        return np, placement, (lambda: Communicator(comm.Dup())), (lambda: None)
    return (xp, placement, (lambda: device_communicator(Communicator(comm.Dup()), xp)),
            xp.cuda.Device().synchronize)


def worker(name: str, repeats: int, stages, device: str = "cpu") -> None:
    """On every rank: the floor, forward + backward without the engine, the data and a training step of
    each stage, interleaved ``repeats`` times between barriers; rank 0 prints the medians."""
    from mpi4py import MPI
    from dataclasses import replace
    from zerompi import ZeroEngine
    from zerompi.engine.timers import KEYS
    from zerompi.train.config import parse_config
    from zerompi.train.job import step_losses
    from zerompi.train.run import _one_blas_thread, build_model
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    _one_blas_thread()
    cfg = parse_config(MODELS[name] + ["--device", device])
    xp, placement, engine_comm, sync = placed(device, comm)
    model, data = build_model(cfg, xp)
    per = cfg.batch // size
    mine = range(rank * per, (rank + 1) * per)
    stand_in = StandIn([(n, {k: xp.asarray(v) for k, v in p.items()}) for n, p in model.init_layers()])
    if cfg.model == "gpt":
        from zerompi.train.models.gpt_chunk import run_micro_batch
        rows = xp.asarray(data.train_rows(0, mine))
        gemms = gpt_gemms(model, per)
        get_data = lambda: data.train_rows(1, mine)
        fwd_bwd = lambda: run_micro_batch(stand_in, model, rows[:, :-1], rows[:, 1:])
    else:
        from zerompi.train.loop import run_micro_batch
        x, y = (xp.asarray(a) for a in data.rows(0, mine))
        gemms = mlp_gemms(cfg, per)
        get_data = lambda: data.rows(1, mine)
        fwd_bwd = lambda: run_micro_batch(stand_in, model, x, y)
    losses_of = step_losses(cfg.model)
    engines = {s: ZeroEngine(model.init_layers(), replace(cfg.zero, stage=s), engine_comm(), xp=xp) for s in stages}
    steps = dict.fromkeys(stages, 0)
    breakdowns = {s: [] for s in stages}

    def train_step(s):
        """The train CLI's step (train/run.py): this rank's rows, forward, backward, optimizer, the loss."""
        engine = engines[s]
        t0 = time.perf_counter()
        engine.timers.take()
        local = losses_of(engine, model, data, steps[s], cfg.batch, cfg.zero.micro_batches)
        engine.step()
        engine.comm.sum_scalars([sum(local) / len(local), 0.0])
        seconds = time.perf_counter() - t0
        parts = engine.timers.take()
        breakdowns[s].append(dict(parts, other=max(0.0, seconds - sum(parts[k] for k in KEYS))))
        steps[s] += 1

    parts = {"floor": floor_fn(gemms, xp), "fwd_bwd": fwd_bwd, "data": get_data}
    parts.update({f"stage{s}": (lambda s=s: train_step(s)) for s in stages})
    for fn in parts.values():                         # warm-up: buffers, kernels, caches, the first gathers
        fn()
    sync()
    for s in stages:
        breakdowns[s].clear()
    times, cpu = {k: [] for k in parts}, {k: [] for k in parts}
    for _ in range(repeats):
        for k, fn in parts.items():
            comm.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()                                    # a GPU's work counts to its end
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            times[k].append(comm.allreduce(dt, op=MPI.MAX))     # the slowest rank
            cpu[k].append(comm.allreduce(dc, op=MPI.MAX))
    hashes = {s: params_sha256(engines[s]) for s in stages}   # the stages' parameters after the same steps
    for engine in engines.values():
        engine.close()
    if rank == 0:                                     # rank 0's breakdown, as the train CLI reports it
        impl = getattr(getattr(model, "layers", None), "name", "numpy")
        print("FLOOR " + json.dumps({"times_s": times, "cpu_s": cpu, "breakdowns_s": breakdowns,
                                     "gemms": sum(g[4] for g in gemms), "kernels": impl,
                                     "device": placement.describe(), "stage_sha256": hashes}), flush=True)


def params_sha256(engine) -> str:
    """The engine's fp32 master parameters' SHA-256 (a collective): equal across stages after equal steps."""
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(engine.unpadded_master()).tobytes()).hexdigest()


# ---- the launcher -------------------------------------------------------------------------------

def _run(cmd, timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def run_worker(name: str, n: int, stages, a) -> dict:
    out = _run([mpiexec(), "-n", str(n), sys.executable, __file__, "--worker", name, "--repeats", str(a.repeats),
                "--stages", ",".join(map(str, stages)), "--device", a.device], a.timeout)
    return json.loads(next(line[6:] for line in out.splitlines() if line.startswith("FLOOR ")))


def run_cli(name: str, n: int, stage: int, a, tmp: Path, tag: str) -> dict:
    """One ``python -m zerompi.train`` run: its median step (the first left out) and time breakdown."""
    path = tmp / f"{tag}.json"
    _run([mpiexec(), "-n", str(n), sys.executable, "-m", "zerompi.train", *MODELS[name], "--stage", str(stage),
          "--device", a.device,
          "--steps", str(a.steps), "--log-every", str(a.steps), "--metrics-json", str(path)]
         + (["--eval-every", "0"] if name.startswith("gpt") else []), a.timeout)
    m = json.loads(path.read_text())
    step = statistics.median(m["step_times_s"][1:])
    return {"step_s": step, "other_s": m["time_breakdown_s"]["other"], "sha256": m["final_params_sha256"]}


def record(name: str, n: int, stages, workers, clis) -> dict:
    """Medians over every (round, repeat); each ratio is taken within one repeat (the same moment) first."""
    med = statistics.median
    pool = lambda k: [t for w in workers for t in w["times_s"][k]]
    ratio = lambda k, of="times_s": med([t / f for w in workers for t, f in zip(w[of][k], w[of]["floor"])])
    rec = {"model": name, "N": n, "flags": MODELS[name], "kernels": workers[0]["kernels"],
           "device": workers[0]["device"], "gemms": workers[0]["gemms"], "rounds": len(workers),
           "floor_s": med(pool("floor")),
           "stages_bit_identical": all(len(set(w["stage_sha256"].values())) <= 1 for w in workers)}
    for k in ("fwd_bwd", "data"):
        rec[f"{k}_s"], rec[f"{k}_over_floor"], rec[f"{k}_cpu_over_floor"] = med(pool(k)), ratio(k), ratio(k, "cpu_s")
    rec["stages"] = {}
    for s in stages:
        parts = [b for w in workers for b in w["breakdowns_s"][str(s)]]
        rec["stages"][s] = st = {"step_s": med(pool(f"stage{s}")), "over_floor": ratio(f"stage{s}"),
                                 "cpu_over_floor": ratio(f"stage{s}", "cpu_s"),
                                 "breakdown_s": {k: med(b[k] for b in parts) for k in parts[0]},
                                 "other_share": med(b["other"] / t for b, t in zip(parts, pool(f"stage{s}")))}
        if clis.get(s):
            st["cli_step_s"] = med(c["step_s"] for c in clis[s])
            st["cli_other_share"] = med(c["other_s"] / c["step_s"] for c in clis[s])
    if any(clis.values()):
        rec["cli_stages_bit_identical"] = len({c["sha256"] for runs in clis.values() for c in runs}) == 1
    return rec


def markdown(records) -> str:
    """The README's table: the floor (ms), then each part's ratio to the floor of the same repeat,
    wall time / CPU time; the largest ``other`` share of a stage's step; the data's time (ms)."""
    stages = sorted({s for r in records for s in r["stages"]})
    head = ("| model | N | GEMM floor, ms | fwd+bwd | " + " | ".join(f"stage {s}" for s in stages)
            + " | other / step (worst stage) | data, ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ms = lambda t: f"{t * 1e3:.1f}" if t >= 0.01 else f"{t * 1e3:.2f}"
    for r in records:
        x = lambda wall, cpu: f"{wall:.2f} / {cpu:.2f}"
        cells = [r["model"], str(r["N"]), ms(r["floor_s"]), x(r["fwd_bwd_over_floor"], r["fwd_bwd_cpu_over_floor"])]
        cells += [x(r["stages"][s]["over_floor"], r["stages"][s]["cpu_over_floor"]) for s in stages]
        cells.append(f"{max(v['other_share'] for v in r['stages'].values()):.1%}" if r["stages"] else "")
        cells.append(ms(r["data_s"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    p.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages ('' = none)")
    p.add_argument("--repeats", type=int, default=5, help="measurements of each part per round, interleaved")
    p.add_argument("--rounds", type=int, default=3, help="runs of every configuration, in random order")
    p.add_argument("--seed", type=int, default=0, help="seeds the order of the runs in each round")
    p.add_argument("--no-cli", dest="cli", action="store_false",
                   help="skip the train CLI runs (their step time and breakdown, and the stages' parity)")
    p.add_argument("--steps", type=int, default=6, help="train CLI: steps per run (the first is left out)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown on stderr")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where the arrays live: cpu (NumPy) or gpu (CuPy; the train CLI runs use --device gpu too)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    stages = [int(s) for s in a.stages.split(",") if s != ""]
    if a.worker:
        worker(a.worker, a.repeats, stages, a.device)
        return 0
    names, ranks = a.models.split(","), [int(n) for n in a.ranks.split(",")]
    unknown = [m for m in names if m not in MODELS]
    if unknown or a.steps < 2 or a.repeats < 1:
        p.error(f"unknown models {unknown}" if unknown else "--steps must be >= 2 and --repeats >= 1")
    jobs = [(m, n, s) for m in names for n in ranks for s in [None] + (stages if a.cli else [])]   # None: the worker
    workers = {(m, n): [] for m in names for n in ranks}
    clis = {(m, n): {s: [] for s in stages} for m in names for n in ranks}
    rng = random.Random(a.seed)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            batch = list(jobs)
            rng.shuffle(batch)
            for i, (m, n, s) in enumerate(batch):
                if s is None:
                    workers[m, n].append(run_worker(m, n, stages, a))
                else:
                    clis[m, n][s].append(run_cli(m, n, s, a, Path(tmp), f"r{r}j{i}"))
    records = [record(m, n, stages, workers[m, n], clis[m, n]) for m in names for n in ranks]
    for rec in records:
        print(json.dumps(rec))
    print(json.dumps({"load_average_at_start": load, "cpus": os.cpu_count(), "rounds": a.rounds,
                      "repeats": a.repeats, "cli_steps": a.steps if a.cli else 0}))
    if a.markdown:
        print(markdown(records), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
