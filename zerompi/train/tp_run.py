"""The train job's tensor parallelism (--tp K): its checks, the formula of its all-reduce bytes, the TP row."""
from ..errors import check


def check_model(cfg) -> None:
    """ConfigError (one line) unless cfg's model can be split over cfg.mesh.tp ranks."""
    k = cfg.mesh.tp
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


def summary(metrics: dict, cfg) -> str:
    """The TP traffic row printed under the communication table (None without tensor parallelism)."""
    from .console import human_bytes
    tp = metrics.get("tensor_parallel")
    if tp is None:
        return None
    passes = 6 if cfg.checkpoint_activations else 4          # with checkpointing the forward's 2 run twice
    blocks = f"{passes} x {cfg.n_layer} blocks" if cfg.model == "gpt" else f"{cfg.depth - 1} layers"
    moe = cfg.n_layer // cfg.moe.moe_every if cfg.model == "gpt" and cfg.moe.on else 0   # their attention's only
    if moe:
        blocks = f"({passes} x {cfg.n_layer - moe} dense + {passes // 2} x {moe} MoE blocks)"
    sent = "- (one step)" if tp["bytes_per_step"] is None else human_bytes(tp["bytes_per_step"])   # None: one ran
    formula = "none derived per pipeline stage yet" if tp["theory_bytes_per_step"] is None else \
        (f"{human_bytes(tp['theory_bytes_per_step'])} = {cfg.zero.micro_batches} micro-batches x {blocks} x "
         f"2(K-1)/K x rows·{'T·d_model' if cfg.model == 'gpt' else 'width'} x 4 B")
    return (f"  {'tp all-reduce':16} {sent:>14}   formula {formula} (K={tp['tp']}; "
            f"{tp['seconds_per_step'] * 1e3:.1f} ms/step, median); model states: {tp['params_local']:,} of "
            f"{tp['params_total']:,} parameters per TP rank, sharded over {tp['dp']} data-parallel ranks")
