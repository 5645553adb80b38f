"""The mixture of experts before launch: the GPT's dense and expert parameters, their model states per rank, and
the expert-parallel all-to-all's bytes per step (the formulas a run prints beside what it measured).

An MoE block keeps the dense block's attention and LayerNorms (4C² + 8C) and adds the router (C·E); its E
experts hold E(2CH + H + C). Under --ep K the dense parameters are sharded over the N ranks, each EP rank's
E/K experts over the N/K ranks holding the same experts (engine/memory.py's theory_bytes for each). The
all-to-all (train/moe_run.py's row): per MoE block and micro-batch, the counts once and four passes of the rows
that leave the rank, balanced and dropless. docs/moe.md.
"""
from typing import Dict, Tuple

from ..engine.memory import theory_bytes


def gpt_moe_params(vocab: int, seq_len: int, d_model: int, n_layer: int, experts: int, hidden: int,
                   every: int = 1) -> Tuple[int, int]:
    """(dense Ψ, expert Ψ over all experts) of the built-in GPT with an MoE MLP in every ``every``-th block."""
    c = d_model
    moe = sum(1 for i in range(n_layer) if (i + 1) % every == 0)
    dense = vocab * c + seq_len * c + 2 * c + (n_layer - moe) * (12 * c * c + 13 * c) \
        + moe * (4 * c * c + 8 * c + c * experts)
    return dense, moe * experts * (2 * c * hidden + hidden + c)


def moe_states(stage: int, itemsize: int, ranks: int, ep: int, dense: int, experts: int) -> Dict[str, Dict[str, int]]:
    """{"dense": model states per rank over ``ranks``, "experts": this EP rank's experts' over ranks / ep}."""
    return {"dense": theory_bytes(stage, dense, ranks, itemsize),
            "experts": theory_bytes(stage, experts // ep, ranks // ep, itemsize)}


def all_to_all_bytes(ep: int, experts: int, top_k: int, d_model: int, tokens: int, blocks: int,
                     micro_batches: int, checkpointed: bool = False) -> int:
    """Bytes one rank sends per step in the EP all-to-alls, balanced and dropless; ``tokens``: of one rank's
    micro-batch. Per MoE block and micro-batch: (K-1)·E/K counts of 8 bytes, and 4 x n·k·(K-1)/K rows of C
    float32 values (the rows out and back in the forward, their gradients out and back in the backward);
    ``checkpointed`` (activation checkpointing): the forward's exchanges twice, so 2 x the counts and 6 passes."""
    if ep == 1:
        return 0
    rows = tokens * top_k * (ep - 1) // ep
    forwards = 2 if checkpointed else 1
    return blocks * micro_batches * (forwards * (ep - 1) * (experts // ep) * 8
                                     + (2 * forwards + 2) * rows * d_model * 4)
