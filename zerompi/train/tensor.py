"""The train job's tensor parallelism (--tp K): its checks, metrics and the TP row (train/parallel.py
builds the mesh and the models). What is reported here: the bytes
each rank sends in TP all-reduces per step (measured around the forward and backward of the
step, beside the model's formula) and a hash of the whole model (every TP rank's pieces).
"""
import hashlib
import statistics

from ..errors import check


def check_model(cfg) -> None:
    """ConfigError (one line) unless cfg's model can be split over cfg.zero.tp ranks."""
    k = cfg.zero.tp
    check(cfg.device != "gpu", f"tp={k} runs on the CPU only for now; use --device cpu (or --tp 1)")
    if cfg.model == "gpt":
        check(cfg.n_head % k == 0, f"tp={k} does not divide n_head={cfg.n_head}; the heads are split over the "
                                   f"TP ranks, so use a divisor of {cfg.n_head}")
        check(cfg.d_model % k == 0, f"tp={k} does not divide d_model={cfg.d_model}")
    else:
        check(cfg.width % k == 0, f"tp={k} does not divide width={cfg.width}; use a divisor of {cfg.width}")
        check(cfg.depth % 2 == 0, f"depth={cfg.depth} is odd; with tp={k} the MLP pairs column- and row-parallel "
                                  "blocks, so use an even depth")


def theory_bytes_per_step(cfg, model, dp: int) -> int:
    """The TP all-reduce bytes one rank sends per step: per micro-batch of batch / dp / micro rows
    (each of them seq_len / sp positions long, model.tp_bytes_per_micro_batch)."""
    rows = cfg.batch // dp // cfg.zero.micro_batches
    return cfg.zero.micro_batches * model.tp_bytes_per_micro_batch(rows)


def metrics(cfg, engine, model, log, base: dict) -> dict:
    """The TP entries of the metrics (a collective over the TP group: the whole model's hash)."""
    mesh, split = engine.tp.mesh, engine.tp.split
    tp_bytes, tp_seconds = log.group_series("tp")
    digests = mesh.tp_mpi.allgather(base["final_params_sha256"])   # each TP rank's pieces, in TP rank order
    full = sum(pr.numel * (mesh.tp if name in split else 1) for name, pr in engine.layout.params.items())
    whole = None if None in digests else hashlib.sha256("".join(digests).encode()).hexdigest()   # None: simulated
    return {"final_params_sha256": whole,
            "tensor_parallel": {"tp": mesh.tp, "dp": mesh.dp, "params_total": full,
                                "params_local": engine.layout.params_numel,
                                "bytes_per_step": int(statistics.median(tp_bytes)) if tp_bytes else 0,
                                "theory_bytes_per_step": theory_bytes_per_step(cfg, model, mesh.dp),
                                "seconds_per_step": statistics.median(tp_seconds) if tp_seconds else 0.0}}


def summary(metrics: dict, cfg) -> str:
    """The TP traffic row printed under the communication table (None without tensor parallelism)."""
    from .report import human_bytes
    tp = metrics.get("tensor_parallel")
    if tp is None:
        return None
    passes = 6 if cfg.checkpoint_activations else 4          # with checkpointing the forward's 2 run twice
    blocks = f"{passes} x {cfg.n_layer} blocks" if cfg.model == "gpt" else f"{cfg.depth - 1} layers"
    return (f"  {'tp all-reduce':16} {human_bytes(tp['bytes_per_step']):>14}   formula "
            f"{human_bytes(tp['theory_bytes_per_step'])} = {cfg.zero.micro_batches} micro-batches x {blocks} x "
            f"2(K-1)/K x rows·{'T·d_model' if cfg.model == 'gpt' else 'width'} x 4 B (K={tp['tp']}; "
            f"{tp['seconds_per_step'] * 1e3:.1f} ms/step, median); model states: {tp['params_local']:,} of "
            f"{tp['params_total']:,} parameters per TP rank, sharded over {tp['dp']} data-parallel ranks")
