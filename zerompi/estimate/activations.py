"""The built-in GPT's activation bytes per rank, with and without activation checkpointing.

One concern: the formula. It counts the arrays a training micro-batch of the GPT holds
(models/gpt.py on the C kernels of models/gpt_fast.py, buffers from the model's workspace,
kept across steps, so all of them are held at once: the sum is the peak). The model
measures the same arrays as it allocates them (models/activations.py); tests check the two
are equal. In elements, with n = B * T rows (B sequences per rank per micro-batch, T
positions), C channels, H heads, V vocabulary, L blocks and A = B * H * T * T:

- a block's forward keeps, per block: its LayerNorm outputs, q/k/v, attention output,
  residual, MLP pre-activation and GELU output, and its output (16 n C), the LayerNorms'
  row means and 1 / std (4 n), and the attention probabilities (A);
- a block's backward: its input gradient and its residual's (2 n C per block), and the
  scratch every block's backward shares (d fc 4 n C, d qkv 3 n C, three more n C, and the
  attention's A): 10 n C + A;
- the final LayerNorm: output, input gradient, row means and 1 / std (2 n C + 2 n); the
  embedding output (n C); the tied head: logits and their softmax / gradient (2 n V), the
  gradient into the final LayerNorm (n C); the embedding backward's one-hot (n V).

With checkpointing (``checkpoint=True``) a block keeps only its input: the forward runs
every block in one shared set of buffers and copies each block's output aside (L n C); the
backward runs a block's forward again in that set, then its backward with input-gradient
buffers that alternate between two blocks (2 min(L, 2) n C in place of 2 L n C).

With tensor parallelism over ``tp`` ranks (models/gpt.py: each holds n_head/tp heads, c = C/tp of the
channels of q, k, v and of the attention output, 4c of the MLP's), the split layers' arrays shrink: per block the
forward keeps 4 n C (LayerNorm outputs, residual, output) + 12 n c (q/k/v, attention output, MLP
pre-activation and GELU output) + 4 n + A, the backward's shared scratch is 2 n C (the all-reduced
d m and d a) + 8 n c (d fc, d qkv, d y) + A, with A = B (H/tp) T^2; the input gradients, the ends and
the checkpointed outputs are whole (n C). Sequence parallelism's all-to-all buffers are 10 n c.

Not counted: arrays of one value per row (the head's row maxima and sums, n elements each,
freed within the head), the one-block fp32 copies of fp16/bf16 parameters and the
parameter-gradient buffers the blocks share (parameter-sized, not batch-sized), and any
temporary a NumPy call makes inside itself.
"""
from typing import Dict

from ..errors import check


def _sizes(batch, seq_len, d_model, n_head, sp, tp):
    """(n, C, c, A): the rows of this rank's chunk, the whole and the split channels, the probabilities of its heads."""
    return batch * seq_len // sp, d_model, d_model // tp, batch * (n_head // (sp * tp)) * seq_len * seq_len


def gpt_activation_elements(batch: int, seq_len: int, d_model: int, n_layer: int, n_head: int, vocab: int,
                            checkpoint: bool = False, sp: int = 1, tp: int = 1) -> Dict[str, int]:
    """Elements of the GPT's activation arrays per rank, by term; ``batch``: sequences per rank per
    micro-batch; ``sp``: ranks sharing each sequence (sequence parallelism, K); ``tp``: ranks sharing each
    block (tensor parallelism). Keys: kept (what the forward keeps for the backward), backward (its
    scratch), ends (embedding, final LayerNorm, head), all_to_all (the blocks' shared all-to-all buffers,
    0 without sequence parallelism), total."""
    L, V, K = n_layer, vocab, sp
    n, C, c, A = _sizes(batch, seq_len, d_model, n_head, sp, tp)
    block = 4 * n * C + 12 * n * c + 4 * n + A      # one block's forward buffers
    if checkpoint:
        kept = block + L * n * C                    # one shared set + each block's output
        grads = 2 * min(L, 2) * n * C               # input gradients of two alternating blocks
    else:
        kept = L * block
        grads = 2 * L * n * C
    backward = grads + 2 * n * C + 8 * n * c + A
    ends = (2 * n * C + 2 * n) + n * C + (2 * n * V + n * C) + n * V
    exchange = 10 * n * c if K > 1 else 0        # models/gpt_sp.py: the chunk's qkv, the heads' output, send, recv
    return {"kept": kept, "backward": backward, "ends": ends, "all_to_all": exchange,
            "total": kept + backward + ends + exchange}


def gpt_chunk_activation_elements(batch: int, seq_len: int, d_model: int, blocks: int, n_head: int, vocab: int,
                                  first: bool, last: bool, split: bool = False, sp: int = 1,
                                  checkpoint: bool = False, tp: int = 1) -> Dict[str, int]:
    """Elements a pipeline chunk of ``blocks`` blocks holds (models/gpt_chunk.py), as gpt_activation_elements counts
    them, in two parts. ``per_micro_batch``: what each micro-batch in flight holds in its own workspace -- the
    blocks' kept buffers (with ``checkpoint`` each block's output only), their input gradients (2 n C per block;
    checkpointing: two alternating sets; a split backward, ``split``, also keeps each block's d fc and d qkv,
    7 n C, to its W), the embedding's output and one-hot on the first chunk, the final LayerNorm and the head
    on the last. ``per_chunk``: what the chunk's micro-batches share, one set (models/chunks.py): a block
    backward's scratch (10 n C + A; with a split backward 3 n C + A), the SP all-to-alls' 10 n C, and a
    recomputing block's forward set. ``sp``: ranks sharing each sequence (n = B T/K rows, A = B (H/K) T^2);
    ``tp``: ranks sharing each block (the split layers' arrays in c = C/tp, as gpt_activation_elements)."""
    L, V, K = blocks, vocab, sp
    n, C, c, A = _sizes(batch, seq_len, d_model, n_head, sp, tp)
    check(not (checkpoint and split), "checkpointing does not apply to a split backward")
    block = 4 * n * C + 12 * n * c + 4 * n + A
    kept = L * n * C if checkpoint else L * block
    grads = (2 * min(L, 2) if checkpoint else 2 * L) * n * C + (L * 7 * n * c if split else 0)
    ends = (n * C + n * V if first else 0) + ((2 * n * C + 2 * n) + (2 * n * V + n * C) if last else 0)
    scratch = 2 * n * C + (n * c if split else 8 * n * c) + A     # d m and d a whole; d y (d fc, d qkv) split
    exchange = 10 * n * c if K > 1 else 0        # models/gpt_sp.py's shared all-to-all buffers
    return {"per_micro_batch": kept + grads + ends, "per_chunk": scratch + exchange + (block if checkpoint else 0)}


def gpt_chunks_activation_bytes(in_flight: Dict[int, int], chunks: int, batch: int, seq_len: int, d_model: int,
                                n_layer: int, n_head: int, vocab: int, split: bool = False, sp: int = 1,
                                checkpoint: bool = False, itemsize: int = 4, tp: int = 1) -> int:
    """The GPT's activation bytes on one pipeline rank: for each of its chunks (``in_flight``: {chunk: the most
    micro-batches of it held at once}, pipeline/timeline.in_flight) of ``chunks``, its micro-batches in flight x
    per_micro_batch, and per_chunk once (gpt_chunk_activation_elements: the rank's chunks share one set), in the
    compute dtype's ``itemsize``."""
    total, shared = 0, 0
    for c, held in in_flight.items():
        e = gpt_chunk_activation_elements(batch, seq_len, d_model, n_layer // chunks, n_head, vocab, c == 0,
                                          c == chunks - 1, split, sp, checkpoint, tp)
        total += held * e["per_micro_batch"]
        shared = max(shared, e["per_chunk"])
    return itemsize * (total + shared)


def gpt_activation_bytes(batch: int, seq_len: int, d_model: int, n_layer: int, n_head: int, vocab: int,
                         checkpoint: bool = False, itemsize: int = 4, sp: int = 1, tp: int = 1) -> Dict[str, int]:
    """gpt_activation_elements in bytes (``itemsize``: the compute dtype's, 4 for float32)."""
    for name, v in (("batch", batch), ("seq_len", seq_len), ("d_model", d_model), ("n_layer", n_layer),
                    ("n_head", n_head), ("vocab", vocab), ("sp", sp), ("tp", tp)):
        check(isinstance(v, int) and v >= 1, f"{name}={v!r} must be an integer >= 1")
    check(d_model % n_head == 0, f"d_model={d_model} is not divisible by n_head={n_head}")
    check(n_head % (sp * tp) == 0, f"sp={sp} does not divide n_head={n_head}" if tp == 1 else
          f"tp={tp} does not divide n_head={n_head}" if sp == 1 else
          f"sp={sp} does not divide the {n_head // tp} heads per TP rank (n_head={n_head}, tp={tp})")
    check(d_model % tp == 0, f"tp={tp} does not divide d_model={d_model}")
    check(seq_len % sp == 0, f"sp={sp} does not divide seq_len={seq_len}")
    return {k: v * itemsize for k, v in
            gpt_activation_elements(batch, seq_len, d_model, n_layer, n_head, vocab, checkpoint, sp, tp).items()}


def formula_text(checkpoint: bool, itemsize: int = 4, sp: int = 1, tp: int = 1) -> str:
    """The formula in one line: n = B*T, A = B*H*T*T (with sequence parallelism over K ranks: n = B*T/K,
    A = B*(H/K)*T*T, and 10nC of all-to-all buffers; with tensor parallelism the split layers' arrays in
    c = C/tp, A of H/tp heads), bytes = itemsize x elements."""
    extra = 10 if sp > 1 else 0
    if tp == 1:
        body = (f"L nC + 2 min(L,2) nC + {30 + extra}nC + 6n + 2A + 3nV" if checkpoint else
                f"L (18nC + 4n + A) + {14 + extra}nC + 2n + A + 3nV")
    else:
        body = (f"L nC + 2 min(L,2) nC + 10nC + {20 + extra}nc + 6n + 2A + 3nV" if checkpoint else
                f"L (6nC + 12nc + 4n + A) + 6nC + {8 + extra}nc + 2n + A + 3nV")
    where = ([f"n = BT/{sp}"] if sp > 1 else []) + ([f"c = C/{tp}"] if tp > 1 else [])
    heads = f"H/{sp * tp}" if sp * tp > 1 else ""
    where += [f"A = B({heads})T²"] if heads else []
    return f"{itemsize}({body})" + (f" with {', '.join(where)}" if where else "")


GPT_FLAGS = ("n_layer", "d_model", "n_head", "seq_len", "batch", "vocab")   # the estimate's GPT options


def gpt_layer_sizes(vocab: int, seq_len: int, d_model: int, n_layer: int):
    """Parameters of each engine layer of the built-in GPT: embeddings, blocks, final LayerNorm."""
    c = d_model
    return [vocab * c + seq_len * c] + [12 * c * c + 13 * c] * n_layer + [2 * c]


def gpt_activations(dims: dict, ranks: int, micro_batches: int = 1, checkpoint: bool = False, sp: int = 1,
                    tp: int = 1) -> dict:
    """The estimate's activation entry for a GPT of ``dims`` (GPT_FLAGS; ``batch``: sequences per step
    over all ranks, as zerompi.train --batch): rows per rank per micro-batch, bytes by term, the
    formula; ``sp``: ranks sharing each sequence (their rows are the same); ``ranks``: the TP groups
    (N/tp) with ``tp`` ranks each. Raises ConfigError on bad input."""
    for name in GPT_FLAGS:
        v = dims[name]
        check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name}={v!r} must be an integer >= 1")
    check(ranks % sp == 0, f"sp={sp} does not divide the {ranks} ranks; use a divisor of {ranks}")
    dp = ranks // sp
    parts = dp * micro_batches
    what = f"{ranks} ranks" if sp == 1 else f"{dp} data-parallel ranks"
    check(dims["batch"] % parts == 0, f"batch={dims['batch']} does not split over {what} x {micro_batches} "
                                      f"micro-batches; use a multiple of {parts}")
    rows = dims["batch"] // parts
    terms = gpt_activation_bytes(rows, dims["seq_len"], dims["d_model"], dims["n_layer"], dims["n_head"],
                                 dims["vocab"], checkpoint, sp=sp, tp=tp)
    return {"bytes": terms["total"], "terms": terms, "rows_per_rank": rows, "checkpoint": checkpoint,
            "sp": sp, "tp": tp, "formula": formula_text(checkpoint, sp=sp, tp=tp), **dims}


def with_activations(est: dict, act: dict) -> dict:
    """The estimate with the activations on every stage's row: activation_bytes, and the totals with them
    (total_bytes_with_activations, and its best case): what a rank needs."""
    for row in est["stages"]:
        row["activation_bytes"] = act["bytes"]
        row["total_bytes_with_activations"] = row["total_bytes"] + act["bytes"]
        row["total_bytes_with_activations_best_case"] = row["total_bytes_best_case"] + act["bytes"]
    return dict(est, activations=act)
