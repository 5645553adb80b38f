"""The train job's mixture of experts (--experts): what the MoE blocks routed each step, over the world, and
the run's ``moe`` metrics section and summary row.

Each step the MoE blocks count (moe/mlp.py's MoEStats) the tokens each expert kept, the assignments dropped
over capacity and the load-balancing loss of every forward pass; ``MoELog.record`` sums them over the ranks (one
small collective) and keeps, per step, the tokens per expert (min / mean / max over the MoE blocks' experts),
the drops and the mean aux loss (E · Σ_e f_e p_e: 1 when balanced).
"""
from typing import List, Optional

import numpy as np


class MoELog:
    """The per-step routing record of ``model`` (a GPT with MoE blocks) over ``comm``'s ranks."""

    def __init__(self, cfg, model, comm, ep=None, stages: int = 1):
        self.cfg, self.mlp, self.comm, self.ep, self.stages = cfg, model.moe_blocks.mlp, comm, ep, stages
        self.stats = self.mlp.stats
        self.blocks = [i for i in range(model.n_layer) if model.is_moe(i)]
        self.steps: List[dict] = []
        self.norms: List[float] = []     # the step's gradient norm over the whole model (nan: skipped)
        self.sent0 = 0                   # --ep: the EP group's all-to-all bytes before this step
        tp = getattr(model, "tp", None)  # --tp: every TP rank routes the same rows; TP rank 0's are counted
        self.counted = tp is None or tp.rank == 0
        self.ranks = comm.size // (tp.size if tp else 1)     # the ranks whose tokens are counted (all stages')

    def begin(self) -> None:
        """Forget what ran since the last step (the held-out passes)."""
        self.stats.take()
        self.sent0 = self.ep.ep.bytes_sent() if self.ep else 0
        self.seconds0 = self.ep.ep.seconds() if self.ep else 0.0

    def record(self) -> None:
        """The step's routing summed over the ranks (a collective: every rank calls it); with --bias-update,
        each block's selection bias moved by the step's global counts."""
        routed = self.stats.routed
        tokens, dropped, aux_sum, passes = self.stats.take()
        E, L = self.cfg.moe.experts, len(self.blocks)
        per = [tokens.get(b, np.zeros(E, np.int64)) for b in self.blocks] \
            + [routed.get(b, np.zeros(E, np.int64)) for b in self.blocks]
        sent = self.ep.ep.bytes_sent() - self.sent0 if self.ep else 0
        seconds = self.ep.ep.seconds() - self.seconds0 if self.ep else 0.0
        local = np.concatenate(per + [np.array([seconds, sent, dropped, aux_sum, passes], np.float64)])
        local *= self.counted
        total = self.comm.sum_scalars([float(v) for v in local])
        t = total[:E * L]
        if self.cfg.moe.bias_update > 0:
            for i, b in enumerate(self.blocks):
                self.mlp.update_bias(b, total[E * (L + i):E * (L + i + 1)])
        self.steps.append({"tokens_min": int(t.min()), "tokens_mean": float(t.mean()), "tokens_max": int(t.max()),
                           "dropped": int(total[-3]), "aux_loss": float(total[-2] / max(total[-1], 1.0)),
                           "all_to_all_bytes": float(total[-4] / self.ranks),
                           "all_to_all_seconds": float(total[-5] / self.ranks)})

    def metrics(self) -> dict:
        """The run's ``moe`` section: the settings, and the per-step series of this run's steps."""
        m = self.cfg.moe
        series = {key: [s[key] for s in self.steps] for key in
                  ("tokens_min", "tokens_mean", "tokens_max", "dropped", "aux_loss", "all_to_all_bytes",
                   "all_to_all_seconds")}
        return {"experts": m.experts, "top_k": m.top_k, "moe_every": m.moe_every, "moe_blocks": self.blocks,
                "capacity_factor": m.capacity_factor, "aux_coef": m.aux_coef,
                "expert_hidden": m.expert_hidden or 4 * self.cfg.d_model, "shared_experts": m.shared_experts,
                "ep": m.ep, **series,
                "grad_norms": list(self.norms), "bias_update": m.bias_update,
                "bias": {str(b): v.tolist() for b, v in sorted(self.mlp.bias.items())},
                **all_to_all_theory(self.cfg, len(self.blocks), self.ranks // self.stages, self.stages),
                "memory_bytes_by_engine": None}


def all_to_all_theory(cfg, blocks: int, world: int, stages: int = 1) -> dict:     # world: the data-parallel ranks
    """The EP all-to-all's bytes one rank sends per step, balanced and dropless: per MoE block and micro-batch,
    the counts (E/K integers of 8 bytes to each of the K-1 others) once, and four passes of rows -- the tokens'
    rows out and the outputs back in the forward, their gradients out and back in the backward -- each the
    (K-1)/K of its n·k assignment rows (n tokens of this rank's micro-batch) that leave it, C values of 4 bytes.
    With ``stages`` pipeline stages each rank exchanges for its stage's blocks only: the mean over the ranks,
    the formula over all the blocks divided by the stages."""
    m, z = cfg.moe, cfg.zero
    K = m.ep
    if K == 1:
        return {"all_to_all_theory_bytes": 0, "all_to_all_formula": "none (--ep 1)"}
    from ...estimate.moe_bytes import all_to_all_bytes
    n = cfg.batch // (world * z.micro_batches) * cfg.seq_len
    ckpt = cfg.checkpoint_activations           # the forward's exchanges run again in the backward
    total = all_to_all_bytes(K, m.experts, m.top_k, cfg.d_model, n, blocks, z.micro_batches, ckpt)
    return {"all_to_all_theory_bytes": total if stages == 1 else total / stages,
            "all_to_all_formula": ("" if stages == 1 else f"over {stages} stages: 1/{stages} of ")
            + f"{blocks} MoE blocks x {z.micro_batches} micro-batches x ("
              f"{'2 x ' if ckpt else ''}(K-1)·E/K·8 + {6 if ckpt else 4} x n·k·(K-1)/K x C x 4 B), "
              f"n = {n} tokens, K = {K}"}


def metrics(job) -> Optional[dict]:
    """The ``moe`` section of a job's metrics (null without --experts)."""
    log = getattr(job, "moe_log", None)
    if log is None:
        return None
    out = log.metrics()
    if log.ep is not None:               # rank 0's: the dense and the expert engine apart
        out.update(log.ep.memory(getattr(job, "engine", None)))     # a pipelined job's: its chunks' engines
    return out


def summary(metrics: dict) -> Optional[str]:
    """The MoE row under the communication table (None without --experts)."""
    from ..console import human_bytes
    m = metrics.get("moe")
    if not m or not m["aux_loss"]:
        return None
    tokens = f"{m['tokens_min'][-1]}/{m['tokens_mean'][-1]:.1f}/{m['tokens_max'][-1]}"
    return (f"  {'moe':16} {m['experts']} experts, top-{m['top_k']}, blocks {m['moe_blocks']}: last step's tokens "
            f"per expert min/mean/max {tokens}, dropped {m['dropped'][-1]} (over the run {sum(m['dropped'])}); "
            f"aux loss E·Σf·p {m['aux_loss'][0]:.4f} -> {m['aux_loss'][-1]:.4f} (1 = balanced)"
            + (f"\n  {'ep all-to-all':16} {human_bytes(int(m['all_to_all_bytes'][-1])):>14}   formula "
               f"{human_bytes(m['all_to_all_theory_bytes'])} = {m['all_to_all_formula']} (balanced, dropless; the "
               f"last step's mean per rank)" if m["ep"] > 1 else "")
            + "".join(f"\n  {'moe ' + name + ' states':16} {human_bytes(r['measured']):>14}   formula "
                      f"{human_bytes(r['theory'])} ({r['params']:,} parameters over {r['ranks']} ranks; rank 0's)"
                      for name, r in (m["memory_bytes_by_engine"] or {}).items()))


def banner(cfg) -> Optional[str]:
    """The MoE line of the start-up banner (None without --experts)."""
    m = cfg.moe
    if not m.on:
        return None
    cap = "dropless" if m.capacity_factor is None else f"capacity factor {m.capacity_factor}"
    where = "every block" if m.moe_every == 1 else f"the last block of every {m.moe_every}"
    shared = f" + {m.shared_experts} shared" if m.shared_experts else ""
    return (f"  MoE: {m.experts} experts{shared} (hidden {m.expert_hidden or 4 * cfg.d_model}) in {where}, "
            f"top-{m.top_k}, {cap}, aux loss x {m.aux_coef}, ep {m.ep}")
