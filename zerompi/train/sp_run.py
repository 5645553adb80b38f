"""The train job's sequence parallelism (--sp K, DeepSpeed-Ulysses): its checks, the formula and the SP row.

K adjacent ranks (or TP groups) share each sequence, T/K positions each (models/gpt_sp.py); ZeRO shards over
the dp x sp ranks (engine/tp_groups.py).
"""
from ..errors import check

SP_MODELS = ("gpt",)          # the built-in models with a sequence-parallel version


def check_model(cfg) -> None:
    """ConfigError (one line) unless cfg's model can split its sequences over cfg.mesh.sp ranks (after tp)."""
    k, tp = cfg.mesh.sp, cfg.mesh.tp
    check(cfg.model in SP_MODELS, f"sp={k} needs a model with a sequence-parallel version ({', '.join(SP_MODELS)}); "
                                  f"model {cfg.model} has none (it has no sequence), so use --model gpt or --sp 1")
    heads = cfg.n_head // tp if cfg.n_head % tp == 0 else None
    where = f"n_head={cfg.n_head}" if tp == 1 else f"the {heads} heads per TP rank (n_head={cfg.n_head}, tp={tp})"
    check(heads is None or heads % k == 0, f"sp={k} does not divide {where}; each sequence-parallel rank attends "
                                           f"to 1/sp of them, so use a divisor of {heads}")
    check(cfg.seq_len % k == 0, f"sp={k} does not divide seq_len={cfg.seq_len}; each rank holds seq_len/sp "
                                f"positions, so use a multiple of {k}")


def theory_bytes_per_step(cfg, model, dp: int) -> int:
    """The SP all-to-all bytes one rank sends per step (estimate/sp_bytes.all_to_all_bytes): per micro-batch
    of batch / dp / micro sequences, this rank's seq_len / sp positions of them."""
    from ..estimate.sp_bytes import all_to_all_bytes
    k, rows = cfg.mesh.sp, cfg.batch // dp // cfg.zero.micro_batches
    channels = cfg.d_model // cfg.mesh.tp
    return cfg.zero.micro_batches * all_to_all_bytes(cfg.n_layer, rows, cfg.seq_len // k, channels, k,
                                                     recompute=cfg.checkpoint_activations)


def summary(metrics: dict, cfg):
    """The SP traffic row printed under the communication table (None without sequence parallelism)."""
    from .console import human_bytes
    sp = metrics.get("sequence_parallel")
    if sp is None:
        return None
    c = "C" if sp["tp"] == 1 else "C/tp"
    passes = "3 (forward, its recompute, backward)" if cfg.checkpoint_activations else "2 (forward, backward)"
    step = metrics["step_time_s"]
    sent = "- (one step)" if sp["bytes_per_step"] is None else human_bytes(sp["bytes_per_step"])   # None: one ran
    return (f"  {'sp all-to-all':16} {sent:>14}   formula "
            f"{human_bytes(sp['theory_bytes_per_step'])} = {cfg.zero.micro_batches} micro-batches x {cfg.n_layer} "
            f"blocks x {passes} x 4n{c} x (K-1)/K x 4 B (K={sp['sp']}, n = rows·T/K = rows·{sp['chunk']}; "
            f"{sp['seconds_per_step'] * 1e3:.1f} ms/step, median, of a {step * 1e3:.1f} ms step); attention: "
            f"{sp['heads_per_rank']} heads per rank over all {cfg.seq_len} positions")
