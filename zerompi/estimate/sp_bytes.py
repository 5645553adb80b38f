"""The estimator's sequence parallelism (--sp K, DeepSpeed-Ulysses): the GPT's activations per rank and
its all-to-all bytes per step.

With ``--sp K`` each sequence is cut into K chunks of T/K positions over K ranks (TP groups), whose
all-to-alls give attention the whole sequence for n_head/(tp K) heads. The SP ranks hold the same
parameters, so ZeRO shards over the dp x sp ranks: the stage table is the one for those N/tp ranks.
Per rank and micro-batch (n = B T/K rows of the chunk, C = d_model/tp the channels of its heads):
the activations are estimate/activations.py's with n = B T/K and A = B (H/K) T^2 (the C kernels' path,
tp = 1), and the all-to-alls send per block 4 n C (K-1)/K values in the forward and as many in the
backward (with checkpointing the forward's again in the backward): models/gpt_sp.py.
"""
from ..errors import check
from .activations import gpt_activation_bytes


def all_to_all_bytes(n_layer: int, rows: int, chunk: int, channels: int, sp: int, itemsize: int = 4,
                     recompute: bool = False) -> int:
    """Bytes one rank sends in the SP all-to-alls of one micro-batch of ``rows`` sequences of ``chunk``
    positions each (this rank's chunk), ``channels`` = the channels of its heads (d_model / tp): per
    block 4 n C values in the forward (3 for q, k, v; 1 for the output) and 4 in the backward,
    (K-1)/K of each sent; with activation checkpointing (``recompute``) the forward runs again inside
    the backward, its 4 with it."""
    k = sp
    passes = 3 if recompute else 2
    return n_layer * passes * 4 * (k - 1) * (rows * chunk * channels // k) * itemsize


def gpt_sp(sp: int, tp: int, ranks: int, n_layer: int, d_model: int, n_head: int, vocab: int, seq_len: int,
           batch: int, micro_batches: int = 1, checkpoint: bool = False) -> dict:
    """{sp, tp, dp, rows, chunk, heads_per_rank, all_to_all_bytes_per_step (with and without checkpointing),
    activation_bytes (both, per rank: its chunk, its TP heads)}; ConfigError on bad input."""
    for name, v in (("sp", sp), ("tp", tp), ("ranks", ranks), ("n_layer", n_layer), ("d_model", d_model),
                    ("n_head", n_head), ("vocab", vocab), ("seq_len", seq_len), ("batch", batch),
                    ("micro_batches", micro_batches)):
        check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r} must be a whole number >= 1")
    check(ranks % (tp * sp) == 0, f"sp={sp} does not divide the {ranks // tp if ranks % tp == 0 else ranks} "
                                  f"{'ranks' if tp == 1 else 'tensor-parallel groups'}; use tp x sp dividing {ranks}")
    check(n_head % (tp * sp) == 0, f"sp={sp} does not divide n_head={n_head}" if tp == 1 else
          f"sp={sp} does not divide the {n_head // tp} heads per TP rank (n_head={n_head}, tp={tp})")
    check(seq_len % sp == 0, f"sp={sp} does not divide seq_len={seq_len}")
    check(d_model % n_head == 0, f"d_model={d_model} is not divisible by n_head={n_head}")
    dp = ranks // (tp * sp)
    check(batch % (dp * micro_batches) == 0, f"batch={batch} does not split over {dp} data-parallel ranks x "
                                             f"{micro_batches} micro-batches; use a multiple of {dp * micro_batches}")
    rows, chunk, c = batch // dp // micro_batches, seq_len // sp, d_model // tp
    a2a = {ckpt: micro_batches * all_to_all_bytes(n_layer, rows, chunk, c, sp, recompute=ckpt)
           for ckpt in (False, True)}
    act = {ckpt: gpt_activation_bytes(rows, seq_len, d_model, n_layer, n_head, vocab, ckpt, sp=sp, tp=tp)["total"]
           for ckpt in (False, True)}
    return {"sp": sp, "tp": tp, "dp": dp, "rows": rows, "chunk": chunk, "heads_per_rank": n_head // (tp * sp),
            "checkpoint": checkpoint, "all_to_all_bytes_per_step": a2a[checkpoint],
            "all_to_all_bytes_per_step_by_checkpointing": {"off": a2a[False], "on": a2a[True]},
            "activation_bytes_by_checkpointing": {"off": act[False], "on": act[True]},
            "formula": f"{micro_batches} micro-batches x {n_layer} blocks x {3 if checkpoint else 2} passes x 4nC x "
                       f"(K-1)/K x 4 B, n = {rows}·{chunk}, C = {c}"}


def format_sp(sp: dict) -> str:
    lines = [f"  sequence parallel: K = {sp['sp']} ranks per sequence ({sp['chunk']} of its positions each, "
             f"{sp['heads_per_rank']} heads over all of them in attention) x {sp['dp']} data-parallel"
             + (f" x {sp['tp']} tensor-parallel" if sp['tp'] > 1 else "") + "; ZeRO shards over the "
             f"{sp['dp'] * sp['sp']} data- x sequence-parallel ranks (the model states above)",
             f"  SP all-to-all per rank per step: {sp['all_to_all_bytes_per_step']:,} bytes = {sp['formula']} "
             f"(checkpointing off: {sp['all_to_all_bytes_per_step_by_checkpointing']['off']:,}, on: "
             f"{sp['all_to_all_bytes_per_step_by_checkpointing']['on']:,})"]
    act, c = sp["activation_bytes_by_checkpointing"], "nc, c = C/tp" if sp["tp"] > 1 else "nC"
    lines.append(f"  activations per rank: {act['off']:,} bytes without checkpointing, {act['on']:,} with "
                 f"(n = B T/K, A = B (H/K{'/tp' if sp['tp'] > 1 else ''}) T^2, + 10{c} of all-to-all buffers; "
                 "docs/sequence-parallel.md)")
    return "\n".join(lines)
