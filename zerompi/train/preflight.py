"""What the train CLI checks before the first step: its outputs can be written, a --resume folder is there, an
injected fault fits the job, the job fits in memory. Each returns or raises one line (ConfigError); main() makes
the ranks agree on them."""
import os
from types import SimpleNamespace
from typing import List, Optional, Tuple

from ..checkpoint.outputs import check_file, check_folder, check_roles
from ..errors import ConfigError, check
from .config import TrainConfig
from .tokens import model_vocab


def check_outputs(cfg: TrainConfig, rank: int) -> None:
    """No output where an input, another output or a folder of the run is (this rank's abort trace included);
    --metrics-json and --trace writable on rank 0, --save-dir and --offload-dir on every rank (its files)."""
    from ..checkpoint.savedir import folders_read
    from ..engine.trace import crash_path
    nvme = "nvme" in (cfg.zero.offload_optimizer, cfg.zero.offload_params)
    outputs = [("metrics_json", cfg.metrics_json), ("trace", cfg.zero.trace), ("stop_file", cfg.stop_file)]
    if cfg.zero.trace and rank > 0:
        outputs.append((f"the trace of rank {rank} if it aborts the job", crash_path(cfg.zero.trace, rank)))
    inputs = [("data", cfg.data), ("schedule_file", cfg.pipeline.schedule_file)]
    check_roles(outputs, inputs + folders_read("resume", cfg.resume),
                [("save_dir", cfg.save_dir), ("offload_dir", cfg.zero.offload_dir if nvme else None),
                 ("tensorboard", cfg.tensorboard)])
    if rank == 0:
        check_file(cfg.metrics_json, "metrics_json")
        check_file(cfg.zero.trace, "trace")
    check_folder(cfg.save_dir, "save_dir")
    if cfg.resume is not None and not os.path.isdir(cfg.resume):
        from ..checkpoint.format import resolve
        resolve(cfg.resume)                       # its one line (not there, or a file) before anything starts
    if nvme:                                      # every rank writes its files there
        from ..engine.offload import check_dir
        check_dir(cfg.zero.offload_dir, 0)        # the engine checks the free bytes, once it knows them


def topology_error(cfg: TrainConfig, mpi_comm) -> Optional[str]:
    """With --shard-size and no node size given: the line saying the shard groups do not fit the nodes of MPI's
    shared-memory split (a collective: what the engine would find), else None."""
    from ..comm.topology import check_sizes, node_size_env, node_size_from
    m, n = cfg.mesh, mpi_comm.Get_size()
    if n == 1 or m.shard_size is None or m.node_size is not None or node_size_env() is not None:
        return None
    try:
        check_sizes(n, node_size_from(mpi_comm, None), m.shard_size, m.tp)
    except ConfigError as e:
        return f"{e} (the node size is MPI's shared-memory split; --node-size sets another)"
    return None


def check_fault(fault, world_size: int, cfg: TrainConfig) -> None:
    """ConfigError unless ``fault`` (engine.faults.Fault, or None) can fire: its rank runs, its step is run, and
    its point (save, metrics) comes after that step."""
    if fault is None:
        return
    text = f"ZEROMPI_FAULT='{fault}'"
    check(fault.rank < world_size, f"{text} names rank {fault.rank}; this job has ranks 0-{world_size - 1}")
    if cfg.simulate_world:        # only rank R runs; the others are stand-ins (comm/simulated_world.py): nothing fires
        r = cfg.simulate_rank or 0
        check(fault.rank == r, f"{text} names rank {fault.rank}, a stand-in of the simulated world (--simulate-world "
                               f"{world_size} --simulate-rank {r} runs rank {r} alone); use rank{r}")
    check(fault.step <= cfg.steps, f"{text} names step {fault.step}; this job runs steps 1-{cfg.steps} (--steps)")
    if fault.point == "metrics":
        check(fault.step == cfg.steps, f"{text}: the final metrics follow the last step, {cfg.steps}; "
                                       f"use step{cfg.steps}:metrics")
    if fault.point == "save":
        saves = cfg.save_dir and (fault.step == cfg.steps or (cfg.save_every and fault.step % cfg.save_every == 0))
        check(bool(saves), f"{text}: no checkpoint is saved after step {fault.step} (saves follow the last step "
                           "and every --save-every steps, with --save-dir)")


EXACT_LAYERS = 100_000   # up to this many layers the check lays the model out as the engine does; beyond: closed form


def layer_sizes(cfg: TrainConfig, tp: int = 1) -> List[int]:
    """Parameters of each engine layer of the built-in model on one of ``tp`` TP ranks, without building it
    (models/gpt.py's TP_SPLIT, models/mlp_tp.py). Up to EXACT_LAYERS layers only (else model_size)."""
    if cfg.model == "mlp":
        w = cfg.width
        if tp == 1:
            return [w * w + w] * cfg.depth
        return [(w * w + w) // tp if i % 2 == 0 else w * w // tp + w for i in range(cfg.depth)]
    embed, block, ln_f = _gpt_sizes(cfg, tp)
    return [embed] + [block] * cfg.n_layer + [ln_f]


def _gpt_sizes(cfg: TrainConfig, tp: int) -> Tuple[int, int, int]:
    """Parameters of the GPT's embeddings, of a block (6·d_model of it replicated) and of ln_f on one TP rank."""
    c, vocab = cfg.d_model, model_vocab(cfg)
    return vocab * c + cfg.seq_len * c, (12 * c * c + 7 * c) // tp + 6 * c, 2 * c


def model_size(cfg: TrainConfig, tp: int = 1) -> Tuple[int, int]:
    """(Ψ, the largest engine layer's parameters) on one TP rank, in closed form (--n-layer 10**9: no list)."""
    if cfg.model == "mlp":
        w, d = cfg.width, cfg.depth
        even, odd = (w * w + w) // tp, (w * w // tp + w if tp > 1 else w * w + w)
        return even * ((d + 1) // 2) + odd * (d // 2), max(even, odd if d > 1 else even)
    embed, block, ln_f = _gpt_sizes(cfg, tp)
    return embed + cfg.n_layer * block + ln_f, max(embed, block, ln_f)


def stage_estimate(cfg: TrainConfig, world_size: int) -> dict:
    """zerompi.estimate's row of cfg's stage for one rank (its TP rank's pieces over the N/K data-parallel ranks),
    on the engine's own layout (exact), or from Ψ and the largest layer beyond EXACT_LAYERS layers."""
    from ..estimate.plan import bucket_numel
    from ..estimate.stages import estimate
    from ..layout import FlatLayout
    z, tp = cfg.zero, cfg.mesh.tp
    check(world_size % tp == 0, f"tp={tp} does not divide the {world_size} ranks; use a divisor of {world_size}")
    dp = world_size // tp
    common = dict(ranks=dp, dtype=z.dtype, bucket_mb=z.bucket_mb, prefetch=z.prefetch,
                  micro_batches=z.micro_batches, overlap=z.overlap, align=z.align)
    if (cfg.depth if cfg.model == "mlp" else cfg.n_layer + 2) > EXACT_LAYERS:
        psi, largest = model_size(cfg, tp)
        return estimate(params=psi, largest_layer=largest, **common)["stages"][z.stage]
    spec = [(f"layer{i}", [(f"p{i}", (n,))]) for i, n in enumerate(layer_sizes(cfg, tp))]
    layout = FlatLayout(spec, dp, bucket_numel(z.dtype, z.bucket_mb), z.align)
    return estimate(layout=layout, **common)["stages"][z.stage]


def pipeline_estimate(cfg: TrainConfig, world_size: int, rank: int, schedule=None) -> dict:
    """zerompi.estimate's row for world rank ``rank`` of a pipelined job: the sum of the rows of its stage's chunks,
    each laid out as its engine does (beyond EXACT_LAYERS layers: its blocks alone, a lower bound)."""
    from ..estimate.plan import bucket_numel
    from ..estimate.stages import estimate, sum_rows
    from ..layout import FlatLayout
    from .models.chunks import chunk_layers
    from .pipeline import load_schedule
    z, m, s = cfg.zero, cfg.mesh, schedule or load_schedule(cfg)
    group = world_size // (m.tp * m.pp)           # the stage's ZeRO group: its data- x sequence-parallel ranks
    common = dict(ranks=group, dtype=z.dtype, bucket_mb=z.bucket_mb, prefetch=z.prefetch, overlap=z.overlap,
                  align=z.align, micro_batches=1 if cfg.pipeline.grad_reduce == "step" else z.micro_batches)
    gpt = cfg.model == "gpt"
    blocks = cfg.n_layer if gpt else cfg.depth
    rows = []
    for c in s.chunks_of(pipeline_stage(cfg, world_size, rank)):
        if blocks // s.chunks > EXACT_LAYERS:
            block = _gpt_sizes(cfg, m.tp)[1] if gpt else \
                min(layer_sizes(SimpleNamespace(model="mlp", width=cfg.width, depth=2), m.tp))
            rows.append(estimate(params=blocks // s.chunks * block, largest_layer=block, **common)["stages"][z.stage])
            continue
        sizes = layer_sizes(cfg, m.tp)
        layers = chunk_layers(len(sizes), [0] if gpt else [], [blocks + 1] if gpt else [], blocks, c, s.chunks)
        spec = [(f"layer{g}", [(f"p{g}", (sizes[g],))]) for g in layers]
        layout = FlatLayout(spec, group, bucket_numel(z.dtype, z.bucket_mb), z.align)
        rows.append(estimate(layout=layout, **common)["stages"][z.stage])
    return sum_rows(rows, "chunks")


def pipeline_stage(cfg: TrainConfig, world_size: int, rank: int) -> int:
    """The pipeline stage of world rank ``rank`` (the mesh's order: rank = tp_i + TP (sp_i + SP (dp_i + DP pp_i)))."""
    return rank // (world_size // cfg.mesh.pp)


def _pipeline_activations(cfg: TrainConfig, world_size: int, rank: int, s) -> int:
    """The GPT's activation bytes on a pipelined rank of schedule ``s`` (C kernels), as the run measures them."""
    from ..estimate.activations import gpt_chunks_activation_bytes
    from ..pipeline.timeline import in_flight
    m = cfg.mesh
    stage = pipeline_stage(cfg, world_size, rank)
    rows = max(1, cfg.batch // (world_size // (m.tp * m.sp * m.pp)) // cfg.zero.micro_batches)
    vocab = model_vocab(cfg)
    return gpt_chunks_activation_bytes(in_flight(s, stage), s.chunks, rows, cfg.seq_len, cfg.d_model, cfg.n_layer,
                                       cfg.n_head, vocab, s.split_backward, m.sp, cfg.checkpoint_activations,
                                       tp=m.tp)


def memory_needed(cfg: TrainConfig, world_size: int, rank: int = 0) -> dict:
    """Bytes world rank ``rank`` holds at once at least, by part: model states and buffers (zerompi.estimate, best
    case), and the MLP's teacher or the GPT's activations (on the CPU, as the run measures them; else the
    attention probabilities kept). Lazy initial parameters (engine/lazy.py) add nothing."""
    z, m, tp = cfg.zero, cfg.mesh, cfg.mesh.tp
    if m.pp > 1:
        from .pipeline import load_schedule
        schedule = load_schedule(cfg)            # once, for the model states and the activations
    row = pipeline_estimate(cfg, world_size, rank, schedule) if m.pp > 1 else stage_estimate(cfg, world_size)
    offloaded = (row["optimizer_bytes"] if z.offload_optimizer == "nvme" else 0) + \
        (row["params_bytes"] if z.offload_params == "nvme" else 0)       # in files, not in memory
    parts = {"model states and buffers": row["total_bytes_best_case"] - offloaded}
    if cfg.model == "mlp":        # the teacher is built whole before the engine and kept
        parts["teacher network (float32)"] = 4 * model_size(cfg)[0]
        return parts
    rows = max(1, cfg.batch // (world_size // (tp * m.sp) * z.micro_batches))   # sequences per data-parallel rank
    if m.pp > 1:                                 # the micro-batches in flight in each chunk of the stage
        if cfg.device == "cpu":
            parts["activations"] = _pipeline_activations(cfg, world_size, rank, schedule)
        return parts
    if cfg.device == "cpu":                     # the C kernels' workspace: every activation, by its formula
        from ..estimate.activations import gpt_activation_bytes
        vocab = model_vocab(cfg)
        parts["activations"] = gpt_activation_bytes(rows, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head, vocab,
                                                    cfg.checkpoint_activations, sp=m.sp, tp=tp)["total"]
    else:
        kept = 1 if cfg.checkpoint_activations else cfg.n_layer      # blocks whose probabilities are held at once
        parts["attention probabilities"] = 4 * kept * rows * (cfg.n_head // (tp * m.sp)) * cfg.seq_len ** 2
    return parts


def memory_error(cfg: TrainConfig, world_size: int, placement, rank: int = 0) -> Optional[str]:
    """One line when the job cannot fit in world rank ``rank``'s share of the machine, else None: a lower bound
    is compared, so a job refused here cannot run."""
    from ..estimate.machine import available_per_rank, human_bytes
    have = available_per_rank(placement)
    try:
        parts = memory_needed(cfg, world_size, rank)
    except ConfigError as e:       # the estimate refused the layout: say so, as the ranks agree on it
        return str(e)
    if placement is not None and placement.kind == "gpu":     # the device holds these; the host the rest
        parts = {k: v for k, v in parts.items() if k in ("model states and buffers", "attention probabilities")}
    need = sum(parts.values())
    if have is None or need <= have[0]:
        return None
    tp, sp, pp = cfg.mesh.tp, cfg.mesh.sp, cfg.mesh.pp
    tp_words = "".join(f" x {k} {what}-parallel" for k, what in ((sp, "sequence"), (tp, "tensor")) if k > 1)
    tp_words = f" as {world_size // (tp * sp * pp)} data-parallel{tp_words}" if tp_words or pp > 1 else ""
    if pp > 1:
        tp_words += f" x {pp} pipeline stages; rank {rank}'s stage {pipeline_stage(cfg, world_size, rank)}"
    detail = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items())
    return (f"the job needs at least {human_bytes(need)} per rank ({detail}; stage {cfg.zero.stage}, "
            f"{world_size} ranks{tp_words}, by zerompi.estimate) and this rank has {human_bytes(have[0])} ({have[1]}); "
            + ("use a smaller model, more ranks, a higher --stage or more --pp stages" if pp > 1 else
               "use a smaller model, more ranks, a higher --stage or --offload-optimizer nvme"
               + (" (long sequences: --checkpoint-activations, --sp)" if cfg.model == "gpt" else "")))
