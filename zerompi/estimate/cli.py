"""The command line of ``python -m zerompi.estimate``: its options, its table, and --from-run.

One concern: turning arguments into a call of :func:`~zerompi.estimate.stages.estimate` and
its dict into text. Parses the options (bad input: one line naming the value, exit status
2), prints the table (model states first, then buffers, then communication), and with
``--from-run`` estimates a train run's configuration from its ``--metrics-json`` and puts
the measured bytes beside it. No arithmetic about memory lives here.
"""
import argparse
import json
import math
import sys
from typing import List, Optional

from ..checkpoint.outputs import check_file, save_json
from ..comm.quantized import DEFAULT_BLOCK
from ..engine import reducer
from ..engine.config import ZeroConfig
from ..errors import EXIT_OUTPUT, ConfigError, check, quiet_exit_on_closed_stdout
from .stages import BUFFER_ROWS, DEFAULT_PREFETCH, estimate

UNITS = ((1e9, "GB", 2 ** 30, "GiB"), (1e6, "MB", 2 ** 20, "MiB"), (1e3, "kB", 2 ** 10, "KiB"), (1, "B", 1, "B"))


def _units(largest: float):
    return next(u for u in UNITS if largest >= u[0])


def parse_count(text: str) -> float:
    """'10e9', '1.3e9', '7B', '350M' -> a number of parameters."""
    scale = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(text[-1:], 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. 10e9 or 10B")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; write e.g. 10e9 or 10B")
    return value


def parse_finite(text: str) -> float:
    """A float option: a finite number (inf and nan are refused here, with the option's name)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def format_table(est: dict) -> str:
    """The estimate as the text table the CLI prints: model states first, then buffers, then communication."""
    rows = est["stages"]
    big, unit, bin_, bunit = _units(max(r["total_bytes"] for r in rows))
    dec = lambda b: f"{b / big:12.4f}"
    binary = lambda b: f"{b / bin_:12.4f}"
    line = lambda label, cells: f"  {label:<28}" + "".join(f"{c:>14}" for c in cells)
    out = [f"zerompi.estimate: Ψ = {est['params']:,} parameters, N = {est['ranks']} ranks, {est['dtype']} storage, "
           f"AdamW with an fp32 master ({unit} = {big:,.0f} bytes)",
           line(f"bytes per rank, {unit}", [f"stage {r['stage']}" for r in rows])]
    for key, label in (("params_bytes", "params"), ("grads_bytes", "grads"),
                       ("optimizer_bytes", "optimizer (master, m, v)")):
        out.append(line(label, [dec(r[key]) for r in rows]))
    if est.get("hpz_applies"):
        out.append(line("secondary copy (hpZ)", [dec(r["secondary_bytes"]) if r["secondary_bytes"] else "-"
                                                 for r in rows]))
    out.append(line(f"model states, {unit}", [dec(r["model_state_bytes"]) for r in rows]))
    if est.get("offload", {}).get("optimizer", "none") != "none" or est.get("offload", {}).get("params", "none") != "none":
        for place, label in (("device", "of them on the device"), ("host", "in host memory (offload)"),
                             ("disk", "in files (offload)")):
            out.append(line(label, [dec(r["model_state_bytes_by_place"][place]["total"]) for r in rows]))
    out.append(line(f"model states, {bunit}", [binary(r["model_state_bytes"]) for r in rows]))
    out.append(line("formula", [r["formula"] for r in rows]))
    labels = {"grad_buckets": "gradient buckets", "gathered_params": "gathered layers (stage 3)",
              "spare_buffers": "spare bucket buffers", "grad_accumulator": "micro-batch accumulator",
              "comm_scratch": "reduce-scatter scratch"}
    for key in BUFFER_ROWS:
        out.append(line(f"+ {labels[key]}", [dec(r["buffers"][key]) if r["buffers"][key] else "-" for r in rows]))
    pending = est["in_flight"]
    out.append(line(f"total ({pending:,} pending), {unit}", [dec(r["total_bytes"]) for r in rows]))
    out.append(line(f"total ({pending:,} pending), {bunit}", [binary(r["total_bytes"]) for r in rows]))
    if pending > 0:
        out.append(line(f"total (best case), {unit}", [dec(r["total_bytes_best_case"]) for r in rows]))
    if est.get("by_level"):
        out += level_rows(est, line, dec, unit)
    else:
        out.append(line(f"communication per step, {unit}", [dec(r["comm_bytes_per_step"]) for r in rows]))
        if est.get("quantized"):
            out.append(line(f"  unquantized (logical), {unit}", [dec(r["comm_logical_bytes_per_step"]) for r in rows]))
        out.append(line("collective calls per step", [f"{r['comm_calls_per_step']:,}" for r in rows]))
        out.append(line("communication time, s", [f"{r['comm_seconds_per_step']:.4f}" for r in rows]))
    padding = est["padded_params"] - est["params"]
    out += ["",
            f"layout: {est['buckets']:,} buckets of up to {est['bucket_numel']:,} elements ({est['bucket_mb']:g} MiB), "
            f"{padding:,} padding elements; stage-3 prefetch {est['prefetch']}; "
            f"{est['micro_batches']} micro-batch(es)",
            _pending_note(est)] + quant_notes(est)
    if est.get("by_level"):
        return "\n".join(out + level_notes(est))
    out += [f"communication: ring volumes, (N-1)/N of the buffer per pass; time = calls x (N-1) x "
            f"{est['latency_us']:g} us + bytes / {est['bandwidth_gbps']:g} Gbit/s",
            f"stage 3 moves 3 passes per micro-batch (gather forward, gather backward, reduce-scatter); the engine "
            f"keeps the buckets it holds gathered across each forward/backward turn, so it sends up to "
            f"{rows[3]['comm_bytes_kept_at_turns']:,} bytes less than that"]
    return "\n".join(out)


def level_rows(est: dict, line, dec, unit: str) -> List[str]:
    """The communication rows by level: bytes sent inside and across nodes per step, and their time."""
    rows = est["stages"]
    level = lambda key, lvl: [r[key][lvl] for r in rows]
    out = [line(f"sent inside nodes / step, {unit}", [dec(b) for b in level("comm_bytes_per_step_by_level", "intra")]),
           line(f"sent across nodes / step, {unit}", [dec(b) for b in level("comm_bytes_per_step_by_level", "inter")])]
    if est.get("quantized"):
        out += [line(f"  unquantized inside, {unit}", [dec(b) for b in level("comm_logical_bytes_per_step_by_level",
                                                                             "intra")]),
                line(f"  unquantized across, {unit}", [dec(b) for b in level("comm_logical_bytes_per_step_by_level",
                                                                             "inter")])]
    out += [line("time inside nodes, s", [f"{t:.4f}" for t in level("comm_seconds_per_step_by_level", "intra")]),
            line("time across nodes, s", [f"{t:.4f}" for t in level("comm_seconds_per_step_by_level", "inter")]),
            line("communication time, s", [f"{r['comm_seconds_per_step_levels']:.4f}" for r in rows])]
    if est["nodes"] > 1:
        out += [line(f"if flat: across nodes, {unit}", [dec(b) for b in level("comm_bytes_per_step_if_flat", "inter")]),
                line("if flat: communication time, s",
                     [f"{sum(r['comm_seconds_per_step_if_flat'].values()):.4f}" for r in rows])]
    return out


def level_notes(est: dict) -> List[str]:
    """The footer of the by-level table: the topology, what hpZ applies to, the time model."""
    n, k, s = est["ranks"], est["node_size"], est["shard_size"]
    nodes = f"{est['nodes']} node{'s' if est['nodes'] > 1 else ''} of {k}"
    groups = (f"one shard group of all {n} ranks (N)" if est["shard_groups"] == 1 else
              f"{est['shard_groups']} shard groups of S = {s} ranks, replicated (model states with S in place of N; "
              f"each step all-reduces the gradient shard across the groups)")
    out = [f"topology: {n} ranks in {nodes}; {groups}"]
    if est["hpz"]:
        out.append("hpZ: applies to the stage-3 column only (stages 0-2 keep whole parameters); " +
                   ("a node-local secondary copy of 1/K of the parameters (K = node size), so only the first "
                    "forward after a step gathers across nodes" if est["hpz_applies"] else
                    "no effect here: a shard group is one node, so no gather leaves the node"))
    out.append(f"communication: the bytes the engine sends per step (engine/traffic.py): within a group across "
               f"nodes, a reduce-scatter or all-gather moves (K-1)/K of a bucket inside the node and 1/K x (M-1)/M "
               f"across; time per level = ring steps x {est['latency_us']:g} us + bytes / bandwidth "
               f"({est['intra_gbps']:g} Gbit/s inside nodes, {est['inter_gbps']:g} across), the two levels added")
    if est["nodes"] > 1:
        out.append("if flat: the same collectives flat over each shard group, unaware of nodes, as before two "
                   "levels: (S-K)/S of every bucket crosses (hpZ needs two levels: left out)")
    return out


def quant_notes(est: dict) -> List[str]:
    """The footer line of a quantized estimate: what is quantized, and how a slice travels."""
    q = est.get("quantization") or {}
    if not est.get("quantized"):
        return []
    what = [f"weights {q['weights']} (qwZ: the parameter gathers of stages 1-3)"] if q["weights"] else []
    what += [f"gradients {q['grads']} (qgZ: the reduce-scatters)"] if q["grads"] else []
    return [f"quantized: {' and '.join(what)}, blocks of {q['block']}: a slice of k elements travels as its values "
            f"(k bytes for int8, (k + 1) / 2 for int4, padded to 4) and a 4-byte scale per block; the bytes and "
            f"times above are on the wire, the unquantized rows what the same step would send unquantized "
            f"(stage 0's gradient all-gather, the all-reduce across shard groups and hpZ's gathers inside a node "
            f"travel unquantized)"]


def _pending_note(est: dict) -> str:
    """The footer line that says which bound on pending reductions the totals assume."""
    cap, pending = est["engine_max_pending"], est["in_flight"]
    if not est["overlap"]:
        return ("overlap off: every collective is waited for as it starts, so no reduction is pending when the "
                "next bucket's gradients arrive (the best case)")
    whose = (f"the engine's cap (MAX_PENDING_REDUCES = {cap})" if pending == cap
             else f"--in-flight {pending}; the engine's cap is {cap}")
    return (f"pending: gradient reductions still in flight when the next bucket's gradients arrive, at most "
            f"{pending}: {whose}; best case: none pending (each reduction done before the next bucket fills)")


def run_estimate(metrics: dict, **overrides) -> dict:
    """The estimate for the configuration of a train run (its --metrics-json output)."""
    cfg = metrics.get("config", {})
    zero = cfg.get("zero", {})
    # The MLP's blocks are equal, so --layers depth reproduces its layout exactly.
    layers = cfg.get("depth") if cfg.get("model") == "mlp" else None
    kwargs = dict(params=metrics["params"], ranks=metrics["world_size"], dtype=metrics["dtype"],
                  bucket_mb=zero.get("bucket_mb", ZeroConfig.bucket_mb), layers=layers,
                  micro_batches=zero.get("micro_batches", 1), prefetch=zero.get("prefetch", DEFAULT_PREFETCH),
                  overlap=zero.get("overlap", True), align=zero.get("align", ZeroConfig.align))
    quant = metrics.get("quantization") or {}
    kwargs.update(quantize_weights=quant.get("weights", zero.get("quantize_weights")),
                  quantize_grads=quant.get("grads", zero.get("quantize_grads")),
                  quant_block=quant.get("block", zero.get("quant_block", DEFAULT_BLOCK)))
    topo = metrics.get("topology") or {}
    if topo.get("node_size", metrics["world_size"]) < metrics["world_size"] or \
            topo.get("shard_size", metrics["world_size"]) < metrics["world_size"]:    # nodes or shard groups
        kwargs.update(node_size=topo["node_size"], shard_size=topo["shard_size"], hpz=bool(topo.get("hpz")))
    kwargs.update(overrides)
    return estimate(**kwargs)


RUN_KEYS = ("params", "world_size", "dtype", "stage", "memory_bytes", "peak_buffer_bytes", "comm_bytes_per_step")


def read_run(path: str) -> dict:
    """A train run's --metrics-json, checked for what --from-run reads (ConfigError naming the file)."""
    check(path != "", "from_run='' is an empty path; give a train run's --metrics-json file")
    try:
        with open(path) as f:
            metrics = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"from_run={path!r} is not a readable metrics JSON ({e})")
    what = f"from_run={path!r} is not the --metrics-json of a zerompi.train run"
    check(isinstance(metrics, dict), f"{what} (it holds a JSON {type(metrics).__name__}, not an object)")
    missing = [k for k in RUN_KEYS if k not in metrics]
    check(not missing, f"{what} (it has no {', '.join(missing)})")
    check(metrics["stage"] in (0, 1, 2, 3), f"{what} (stage={metrics['stage']!r})")
    return metrics


def compare_run(est: dict, metrics: dict) -> dict:
    """Measured bytes of a run beside the estimate for its stage (buffers: at the cap and the best case)."""
    row = est["stages"][metrics["stage"]]
    mem = metrics["memory_bytes"]
    measured = {"params_bytes": mem["params"], "grads_bytes": mem["grads"], "optimizer_bytes": mem["optimizer"],
                "model_state_bytes": mem["total"], "buffer_bytes": metrics["peak_buffer_bytes"],
                "total_bytes": mem["total"] + metrics["peak_buffer_bytes"],
                "comm_bytes_per_step": metrics["comm_bytes_per_step"]}
    estimated = {k: row[k] for k in measured}
    if est.get("quantized") and "comm_logical_bytes_per_step" in metrics:    # unquantized, engine/traffic.py
        measured["comm_logical_bytes_per_step"] = metrics["comm_logical_bytes_per_step"]
        estimated["comm_logical_bytes_per_step"] = sum(row["comm_logical_bytes_per_step_by_level"].values())
    levels = metrics.get("comm_bytes_per_step_by_level")
    if levels:        # what the engine sent, by level, beside its formula (engine/traffic.py)
        for lvl in ("intra", "inter"):
            measured[f"comm_{lvl}_bytes_per_step"] = levels[lvl]
            estimated[f"comm_{lvl}_bytes_per_step"] = row["comm_bytes_per_step_by_level"][lvl]
    best = {"buffer_bytes": row["buffer_bytes_best_case"], "total_bytes": row["total_bytes_best_case"]}
    return {"stage": metrics["stage"], "measured": measured, "estimate": estimated,
            "estimate_best_case": best, "estimate_one_in_flight": best}   # the latter: its name before the cap


def format_compare(cmp: dict, est: dict) -> str:
    lines = [f"measured in the run (stage {cmp['stage']}) beside the estimate for its configuration, bytes per rank",
             f"  {'':26}{'measured':>14}{'estimate':>14}{'difference':>12}{'best case':>14}"]
    for key, m in cmp["measured"].items():
        e = cmp["estimate"][key]
        best = cmp["estimate_best_case"].get(key)
        lines.append(f"  {key:26}{m:>14,}{e:>14,}{m - e:>12,}" + (f"{best:>14,}" if best is not None else ""))
    bound = (f"up to {est['in_flight']} reductions pending while the next bucket fills"
             if est["overlap"] else "overlap off, no reduction pending while the next bucket fills")
    lines.append(f"  (estimate: {bound}, the most a rank holds; best case: each reduction done before the next "
                 "bucket fills)")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line and exit 2, not argparse's usage dump
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m zerompi.estimate", description="Memory and communication per rank for ZeRO stages 0-3.")
    p.add_argument("--params", type=parse_count, help="Ψ, parameters of the model (10e9, 10B, 350M)")
    p.add_argument("--ranks", type=int, help="N, data-parallel ranks")
    p.add_argument("--dtype", default="fp16", help="fp16, bf16 or fp32 storage of parameters and gradients")
    p.add_argument("--bucket-mb", type=parse_finite, default=ZeroConfig.bucket_mb, help="bucket size in MiB")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--layers", type=int, help="the model has this many layers of equal size")
    shape.add_argument("--largest-layer", type=parse_count, help="parameters of the largest layer")
    p.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH, help="stage-3 buckets gathered ahead")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=None, metavar="K",
                   help="gradient reductions still pending when the next bucket's gradients arrive, at most "
                        f"(default: the engine's cap, {reducer.MAX_PENDING_REDUCES}; 0: the best case)")
    p.add_argument("--no-overlap", action="store_true",
                   help="as zerompi.train --no-overlap: every collective waited for as it starts")
    p.add_argument("--bandwidth-gbps", type=parse_finite, default=100.0, help="link bandwidth, gigabits per second")
    p.add_argument("--latency-us", type=parse_finite, default=5.0, help="latency per message, microseconds")
    p.add_argument("--node-size", type=int, default=None, metavar="K",
                   help="ranks per node (default: all ranks on one node); prints bytes and time per level")
    p.add_argument("--shard-size", type=int, default=None, metavar="S",
                   help="shard the model states over groups of S ranks (whole nodes), replicated across the "
                        "N/S groups (MiCS / hybrid sharding; default: all ranks)")
    p.add_argument("--hpz", action="store_true",
                   help="ZeRO++ hpZ in the stage-3 column: a node-local copy of 1/K of the parameters, the "
                        "backward gathers inside the node")
    p.add_argument("--intra-gbps", type=parse_finite, default=None, help="bandwidth inside a node, Gbit/s "
                                                                         "(default: --bandwidth-gbps)")
    p.add_argument("--inter-gbps", type=parse_finite, default=None, help="bandwidth across nodes, Gbit/s "
                                                                         "(default: --bandwidth-gbps)")
    p.add_argument("--offload-optimizer", default="none", metavar="none|cpu|nvme",
                   help="where the master and Adam moments live (stages 1-3): the table splits the states by place")
    p.add_argument("--offload-params", default="none", metavar="none|nvme", help="stage 3: parameters in files")
    p.add_argument("--quantize-weights", default=None, metavar="int8",
                   help="ZeRO++ qwZ as zerompi.train's: the parameter gathers travel as int8 blocks (stages 1-3)")
    p.add_argument("--quantize-grads", default=None, metavar="int8|int4",
                   help="ZeRO++ qgZ as zerompi.train's: the gradient reduce-scatters travel quantized")
    p.add_argument("--quant-block", type=int, default=DEFAULT_BLOCK, metavar="B",
                   help="elements per quantization block (a power of two >= 8)")
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    p.add_argument("--from-run", metavar="METRICS.json",
                   help="a train run's --metrics-json: estimate its configuration and show measured beside it")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Exit status: 0; 2 with one line on bad input; 1 (EXIT_OUTPUT) with one line when the table
    was printed but --json could not be written; 141, quietly, when stdout was closed (``| head``)."""
    try:
        try:
            a = build_parser().parse_args(argv)
        except SystemExit as e:              # --help: the usage is printed
            sys.stdout.flush()
            return e.code or 0
        check_file(a.json, "json")           # before any work: a path that cannot take the file is bad input
        largest = None if a.largest_layer is None else int(a.largest_layer)
        opts = dict(bucket_mb=a.bucket_mb, prefetch=a.prefetch, micro_batches=a.micro_batches,
                    in_flight=a.in_flight, bandwidth_gbps=a.bandwidth_gbps, latency_us=a.latency_us,
                    overlap=not a.no_overlap, intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps,
                    offload_optimizer=a.offload_optimizer, offload_params=a.offload_params,
                    quantize_weights=a.quantize_weights, quantize_grads=a.quantize_grads, quant_block=a.quant_block)
        topo = {k: v for k, v in (("node_size", a.node_size), ("shard_size", a.shard_size), ("hpz", a.hpz or None))
                if v is not None}
        if a.from_run is not None:
            metrics = read_run(a.from_run)
            given = {k: v for k, v in (("params", a.params), ("ranks", a.ranks), ("layers", a.layers),
                                       ("largest_layer", largest)) if v is not None}
            try:
                est = run_estimate(metrics, in_flight=a.in_flight, bandwidth_gbps=a.bandwidth_gbps,
                                   latency_us=a.latency_us, intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps,
                                   **given, **topo)
                cmp = compare_run(est, metrics)
            except (KeyError, TypeError, IndexError, AttributeError) as e:
                raise ConfigError(f"from_run={a.from_run!r} is not the --metrics-json of a zerompi.train run "
                                  f"({type(e).__name__}: {e})")
        else:
            check(a.params is not None and a.ranks is not None, "give --params and --ranks (or --from-run)")
            est = estimate(a.params, a.ranks, a.dtype, layers=a.layers, largest_layer=largest, **opts, **topo)
            cmp = None
    except ConfigError as e:
        sys.stderr.write(f"zerompi.estimate: error: {e}\n")
        return 2
    except BrokenPipeError:
        return quiet_exit_on_closed_stdout()
    try:
        print(format_table(est))
        if cmp is not None:
            print()
            print(format_compare(cmp, est))
            est = dict(est, from_run=cmp)
        sys.stdout.flush()
    except BrokenPipeError:
        return quiet_exit_on_closed_stdout()
    problem = save_json(a.json, est, "json") if a.json else None
    if problem:
        sys.stderr.write(f"zerompi.estimate: error: {problem}\n")
        return EXIT_OUTPUT
    return 0
