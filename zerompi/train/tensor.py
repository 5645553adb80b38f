"""The train job's tensor parallelism (--tp K): checks, the mesh, the TP models, metrics and the TP row.

The engine runs over the mesh's data-parallel group (engine/tensor.py); the models split their
blocks over the TP group (models/gpt_tp.py, models/mlp_tp.py). What is reported here: the bytes
each rank sends in TP all-reduces per step (measured around the forward and backward of the
step, beside the model's formula) and a hash of the whole model (every TP rank's pieces).
"""
import hashlib
import statistics

import numpy as np

from ..errors import ConfigError, check


def check_model(cfg) -> None:
    """ConfigError (one line) unless cfg's model can be split over cfg.zero.tp ranks."""
    k = cfg.zero.tp
    check(cfg.device != "gpu", f"tp={k} runs on the CPU only for now; use --device cpu (or --tp 1)")
    check(not cfg.checkpoint_activations, f"checkpoint_activations=True is not available with tp={k} yet (the "
                                          "tensor-parallel GPT keeps its activations); drop one of the two")
    if cfg.model == "gpt":
        check(cfg.n_head % k == 0, f"tp={k} does not divide n_head={cfg.n_head}; the heads are split over the "
                                   f"TP ranks, so use a divisor of {cfg.n_head}")
        check(cfg.d_model % k == 0, f"tp={k} does not divide d_model={cfg.d_model}")
    else:
        check(cfg.width % k == 0, f"tp={k} does not divide width={cfg.width}; use a divisor of {cfg.width}")
        check(cfg.depth % 2 == 0, f"depth={cfg.depth} is odd; with tp={k} the MLP pairs column- and row-parallel "
                                  "blocks, so use an even depth")


def make_mesh(cfg, comm, placement):
    """The Mesh of the job (a collective); its data-parallel group counts into ``comm``'s table."""
    from ..comm.mesh import Mesh
    if placement is not None and placement.xp is not np:
        raise ConfigError(f"tp={cfg.zero.tp} runs on the CPU only for now; use --device cpu (or --tp 1)")
    return Mesh(comm, cfg.zero.tp, cfg.zero.node_size)


def build_model(cfg, mesh, xp=np):
    """(model, data) of cfg.model, split over mesh.tp_comm."""
    if cfg.model == "gpt":
        from .data import make_data
        from .models.gpt_tp import TPGPT
        data = make_data(cfg.data, cfg.seq_len, cfg.seed)
        return TPGPT(data.vocab, cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.d_model, cfg.seed, xp=xp,
                     tp=mesh.tp_comm), data
    from .models.mlp import TeacherData
    from .models.mlp_tp import TPMLP
    return TPMLP(cfg.width, cfg.depth, cfg.seed, tp=mesh.tp_comm), TeacherData(cfg.width, cfg.depth, cfg.seed)


def theory_bytes_per_step(cfg, model, dp: int) -> int:
    """The TP all-reduce bytes one rank sends per step: per micro-batch of batch / dp / micro rows."""
    rows = cfg.batch // dp // cfg.zero.micro_batches
    return cfg.zero.micro_batches * model.tp_bytes_per_micro_batch(rows)


def metrics(cfg, engine, model, log, base: dict) -> dict:
    """The TP entries of the metrics (a collective over the TP group: the whole model's hash)."""
    mesh, split = engine.tp.mesh, engine.tp.split
    tp_bytes, tp_seconds = list(log.tp_bytes), list(log.tp_seconds)
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
    """The TP traffic row printed under the communication table."""
    from .report import human_bytes
    tp = metrics["tensor_parallel"]
    blocks = f"4 x {cfg.n_layer} blocks" if cfg.model == "gpt" else f"{cfg.depth - 1} layers"
    return (f"  {'tp all-reduce':16} {human_bytes(tp['bytes_per_step']):>14}   formula "
            f"{human_bytes(tp['theory_bytes_per_step'])} = {cfg.zero.micro_batches} micro-batches x {blocks} x "
            f"2(K-1)/K x rows·{'T·d_model' if cfg.model == 'gpt' else 'width'} x 4 B (K={tp['tp']}; "
            f"{tp['seconds_per_step'] * 1e3:.1f} ms/step, median); model states: {tp['params_local']:,} of "
            f"{tp['params_total']:,} parameters per TP rank, sharded over {tp['dp']} data-parallel ranks")
