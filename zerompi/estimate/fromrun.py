"""``--from-run``: the estimate for a train run's configuration, read from its ``--metrics-json``,
and the run's measured bytes beside it (a table the estimate's command line prints)."""
import json

from ..comm.quantized import DEFAULT_BLOCK
from ..engine.config import ZeroConfig
from ..errors import ConfigError, check
from ..inputs import JSON_BYTES, read_bytes
from .stages import DEFAULT_PREFETCH, estimate


def run_estimate(metrics: dict, **overrides) -> dict:
    """The estimate for the configuration of a train run (its --metrics-json output); of a pipelined run, for
    the rank of its largest stage (whose memory the run's maxima over ranks are): the sum of the estimates of
    the stage's chunks, each an ordinary ZeRO engine over the stage's data-parallel (x SP) ranks."""
    pipe = metrics.get("pipeline")
    if pipe:
        from .stages import sum_rows
        stages = {}
        for c, (st, n) in enumerate(zip(pipe["stage_of_chunk"], pipe["chunk_params"])):
            if n is not None:
                stages.setdefault(st, []).append(n)
        depth = metrics.get("config", {}).get("depth") if metrics["model"] == "mlp" else None
        ests = {st: [_one_estimate(metrics, n, pipe["dp"] * pipe["sp"], depth and depth // len(pipe["chunk_params"]),
                                   overrides) for n in ns] for st, ns in stages.items()}
        rows = {st: sum_rows([e["stages"][metrics["stage"]] for e in es], "chunks") for st, es in ests.items()}
        stage = max(rows, key=lambda st: rows[st]["model_state_bytes"])
        est = dict(ests[stage][0])
        est["stages"] = list(est["stages"])
        est["stages"][metrics["stage"]] = rows[stage]
        est["pipeline_stage"] = stage
        return est
    return _one_estimate(metrics, metrics["params"], metrics["world_size"], None, overrides)


def _one_estimate(metrics: dict, params: int, ranks: int, layers, overrides: dict) -> dict:
    cfg = metrics.get("config", {})
    zero = cfg.get("zero", {})
    # The MLP's blocks are equal, so --layers depth reproduces its layout exactly.
    layers = layers or (cfg.get("depth") if cfg.get("model") == "mlp" else None)
    kwargs = dict(params=params, ranks=ranks, dtype=metrics["dtype"],
                  bucket_mb=zero.get("bucket_mb", ZeroConfig.bucket_mb), layers=layers,
                  micro_batches=zero.get("micro_batches", 1), prefetch=zero.get("prefetch", DEFAULT_PREFETCH),
                  overlap=zero.get("overlap", True), align=zero.get("align", ZeroConfig.align),
                  optimizer=zero.get("optimizer", "adamw"))
    quant = metrics.get("quantization") or {}
    kwargs.update(quantize_weights=quant.get("weights", zero.get("quantize_weights")),
                  quantize_grads=quant.get("grads", zero.get("quantize_grads")),
                  quant_block=quant.get("block", zero.get("quant_block", DEFAULT_BLOCK)))
    topo = metrics.get("topology") or {}
    if topo.get("node_size", ranks) < ranks or topo.get("shard_size", ranks) < ranks:    # nodes or shard groups
        kwargs.update(node_size=topo["node_size"], shard_size=topo["shard_size"], hpz=bool(topo.get("hpz")))
    kwargs.update(overrides)
    return estimate(**kwargs)


RUN_KEYS = ("params", "world_size", "dtype", "stage", "memory_bytes", "peak_buffer_bytes", "comm_bytes_per_step")


def read_run(path: str) -> dict:
    """A train run's --metrics-json, checked for what --from-run reads (ConfigError naming the file)."""
    check(path != "", "from_run='' is an empty path; give a train run's --metrics-json file")
    try:
        metrics = json.loads(read_bytes(path, f"from_run={path!r}", JSON_BYTES))
    except ConfigError:                             # not a regular file, or too large: its own line
        raise
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
    # estimate_one_in_flight: estimate_best_case's name before the cap
    return {"stage": metrics["stage"], "pipeline_stage": est.get("pipeline_stage"), "measured": measured,
            "estimate": estimated, "estimate_best_case": best, "estimate_one_in_flight": best}


def format_compare(cmp: dict, est: dict) -> str:
    where = "" if cmp.get("pipeline_stage") is None else \
        f", of a rank of pipeline stage {cmp['pipeline_stage']} (its largest: the run's numbers are maxima over ranks)"
    lines = [f"measured in the run (stage {cmp['stage']}) beside the estimate for its configuration{where}, "
             "bytes per rank",
             f"  {'':26}{'measured':>14}{'estimate':>14}{'difference':>12}{'best case':>14}"]
    for key, m in cmp["measured"].items():
        e = cmp["estimate"][key]
        best = cmp["estimate_best_case"].get(key)
        got = (f"{m:>14,}{e:>14,}{m - e:>12,}" if m is not None else f"{'-':>14}{e:>14,}{'':>12}")
        lines.append(f"  {key:26}{got}" + (f"{best:>14,}" if best is not None else ""))
    if any(m is None for m in cmp["measured"].values()):
        lines.append("  (-: the run made one step, and a steady step's traffic leaves out the first: not measured)")
    bound = (f"up to {est['in_flight']} reductions pending while the next bucket fills"
             if est["overlap"] else "overlap off, no reduction pending while the next bucket fills")
    lines.append(f"  (estimate: {bound}, the most a rank holds; best case: each reduction done before the next "
                 "bucket fills)")
    return "\n".join(lines)
