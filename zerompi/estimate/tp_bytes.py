"""The estimator's tensor parallelism: the GPT's parameters per TP rank and its TP all-reduce bytes.

With ``--tp K`` over N ranks, each TP rank holds the replicated parameters (embeddings, LayerNorms,
the row-parallel biases) and 1/K of the split ones (QKV, the attention projection's and the MLP's
matrices, the column-parallel biases); ZeRO then shards those Ψ_local over the N/K data-parallel
ranks (the stage table is the estimate for Ψ_local and N/K). The TP all-reduces of a step: per
micro-batch 4 per block (2 forward, 2 backward; 6 with activation checkpointing, whose backward runs the
forward's 2 again) of rows·T·d_model float32 values, each sending 2(K-1)/K of it from every rank.
The activations per TP rank: estimate/activations.py (``tp``).
"""
from ..errors import ConfigError, check


def gpt_tp(tp: int, ranks: int, n_layer: int, d_model: int, vocab: int, seq_len: int, batch: int,
           micro_batches: int = 1, sp: int = 1, checkpoint: bool = False) -> dict:
    """{tp, dp, params_total, params_local, rows, tp_bytes_per_step, formula} (ConfigError on bad input);
    ``dp``: the N/K ranks ZeRO shards over (data x sequence parallel, with ``sp`` > 1: each of its sp
    ranks holds seq_len/sp positions of the same rows)."""
    for name, v in (("tp", tp), ("ranks", ranks), ("n_layer", n_layer), ("d_model", d_model), ("vocab", vocab),
                    ("seq_len", seq_len), ("batch", batch), ("micro_batches", micro_batches), ("sp", sp)):
        check(isinstance(v, int) and v >= 1, f"{name}={v!r} must be a whole number >= 1")
    check(ranks % tp == 0, f"tp={tp} does not divide the {ranks} ranks; use a divisor of {ranks}")
    check(d_model % tp == 0, f"tp={tp} does not divide d_model={d_model}")
    check((ranks // tp) % sp == 0, f"sp={sp} does not divide the {ranks // tp} tensor-parallel groups of tp={tp} "
                                   f"({ranks} ranks); use a divisor of {ranks // tp}")
    check(seq_len % sp == 0, f"sp={sp} does not divide seq_len={seq_len}")
    dp = ranks // tp
    if batch % (dp // sp * micro_batches):
        raise ConfigError(f"batch={batch} does not split over {dp // sp} data-parallel ranks x {micro_batches} "
                          f"micro-batches")
    L, C = n_layer, d_model
    split = L * (12 * C * C + 7 * C)
    whole = vocab * C + seq_len * C + L * 6 * C + 2 * C
    rows, t = batch // (dp // sp) // micro_batches, seq_len // sp
    calls = 6 if checkpoint else 4
    tp_bytes = micro_batches * calls * L * 2 * (tp - 1) * (rows * t * C // tp) * 4
    return {"tp": tp, "dp": dp, "params_total": whole + split, "params_local": whole + split // tp, "rows": rows,
            "tp_bytes_per_step": tp_bytes,
            "formula": f"{micro_batches} micro-batches x {calls} x {L} blocks x 2(K-1)/K x {rows}·{t}·{C} x 4 B"}


def format_tp(tp: dict) -> str:
    return "\n".join([
        f"  tensor parallel: K = {tp['tp']} TP ranks x {tp['dp']} data-parallel ranks; model states above are "
        f"for Ψ_local = {tp['params_local']:,} of Ψ = {tp['params_total']:,} parameters, sharded over N/K",
        f"  TP all-reduce per rank per step: {tp['tp_bytes_per_step']:,} bytes = {tp['formula']}"])
