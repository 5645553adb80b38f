"""The mixture-of-experts MLP: a router, top-k routing, E expert MLPs, forward and backward by hand.

Rows (tokens) m (n, C) -> sum over the k slots of w_j · expert_{e_j}(m): the router's logits m·W_r are put
through a softmax over the experts in at least float32, the top k taken (ties to the lower expert index), their
probabilities renormalised to sum to 1. Each expert is the GPT's MLP (C -> H GELU -> C), its parameters stacked
over the experts (``experts.fc.w`` is (E, C, H)). Assignments are ordered slot-major (every token's first choice,
then every token's second); with a capacity an expert keeps its first ``capacity`` assignments in that order,
the rest dropped (their rows pass by the residual only). The load-balancing loss (Switch, GShard) is
E · Σ_e f_e · p_e, f_e the share of the assignments routed to e, p_e the mean router probability; its
gradient (times ``aux_coef``) flows into the router through p_e. Everything is combined in a fixed order (by
slot, by expert), so the bits depend on nothing but the rows. With ``bias_rate`` γ > 0 (DeepSeek-V3's
aux-loss-free balancing) a per-expert bias is added to the probabilities for the top-k choice only (the
weights stay the probabilities'), moved by γ · sign(mean load - load) after each step on the step's global
counts (train/moe/routing.py). With ``shared`` S > 0 (DeepSeek-style shared experts) S more expert MLPs of the
same shape run on every row, no router weight, their outputs added after the routed ones in index order
(``shared.fc.w`` is (S, C, H)): dense parameters of the block, drawn before its routed experts. docs/moe.md.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..models.gpt_numpy import gelu, gelu_grad

# Short names of an MoE block's MLP parameters (beside the router's ``router.w``), stacked over the experts.
EXPERT_KEYS = ("experts.fc.w", "experts.fc.b", "experts.out.w", "experts.out.b")
# The shared experts' (every row through each of them, no router weight), stacked over the S shared experts.
SHARED_KEYS = ("shared.fc.w", "shared.fc.b", "shared.out.w", "shared.out.b")
ROUTER = "router.w"


@dataclass(frozen=True)
class MoESpec:
    """The MoE MLP's sizes and rules (train/moe/config.py's MoEConfig, with the hidden width resolved)."""

    experts: int
    top_k: int
    hidden: int
    every: int = 1
    capacity_factor: Optional[float] = None
    aux_coef: float = 0.01
    bias_rate: float = 0.0
    shared: int = 0

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (0-based) has the MoE MLP: every ``every``-th, the last of each run of them."""
        return (block + 1) % self.every == 0

    def capacity(self, n: int) -> Optional[int]:
        """Assignments one expert keeps of ``n`` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * n * self.top_k / self.experts))


def host(xp, a) -> np.ndarray:
    """``a`` on the host: itself on NumPy, the explicit copy down on CuPy (counts MPI and the stats read)."""
    return np.asarray(a) if xp is np else xp.asnumpy(a)


def softmax(xp, logits):
    """Row softmax in at least float32 (float64 stays float64)."""
    z = logits.astype(np.promote_types(logits.dtype, np.float32))
    z = z - z.max(axis=1, keepdims=True)
    e = xp.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class Routing:
    """One micro-batch's routing of ``n`` rows: ``top`` (n, k) experts, renormalised weights ``weights`` (n, k),
    and per expert the slot-major assignment positions it keeps (``kept[e]``: positions q = slot·n + token)."""

    def __init__(self, xp, spec: MoESpec, probs, bias=None, sp=None, seqs: int = 1):
        n, k, E = probs.shape[0], spec.top_k, spec.experts
        self.n, self.probs = n, probs
        score = probs if bias is None else probs + xp.asarray(bias.astype(probs.dtype))  # the choice's only
        self.top = xp.argsort(-score, axis=1, kind="stable")[:, :k]
        chosen = xp.take_along_axis(probs, self.top, axis=1)
        self.total = chosen.sum(axis=1, keepdims=True)
        self.weights = chosen / self.total
        flat = self.top.T.reshape(-1)                        # slot-major: q = j * n + t
        self.routed = xp.bincount(flat, minlength=E)         # assignments each expert was chosen for
        self.routed_host = host(xp, self.routed).astype(np.int64)      # the one copy down of the routing
        if spec.capacity_factor is not None and sp is not None and sp.size > 1:
            self.kept = self._kept_whole(xp, spec, sp, seqs)
        else:
            cap = spec.capacity(n)
            order = xp.argsort(flat, kind="stable")          # by expert, slot-major inside each
            bounds = np.concatenate([[0], np.cumsum(self.routed_host)])
            self.kept = [order[bounds[e]:bounds[e + 1]][:cap] for e in range(E)]
        self.tokens = np.array([len(q) for q in self.kept], np.int64)    # kept per expert
        self.dropped = int(n * k - self.tokens.sum())
        self.whole = None       # sequence parallelism: (routed, probability sums, n) over the whole sequences

    def _kept_whole(self, xp, spec: MoESpec, sp, seqs: int):
        """The capacity under sequence parallelism, decided over the whole micro-batch as the unsplit run
        decides it: ``sp`` (an SPComm) holds chunk ``sp.rank`` of each of the ``seqs`` sequences (rows ordered
        sequence-major, this rank's n / seqs positions of each). Every rank's choices are gathered (a few float64
        numbers per token over the SP group, exact), the capacity is that of the whole n · sp tokens, and the
        first-come order is the unsplit one: slot-major, then sequence, then position over the whole sequence.
        Returns this rank's kept positions per expert (slot-major, as without SP)."""
        k, K, E, n = spec.top_k, sp.size, spec.experts, self.n
        t = n // seqs                                        # this rank's positions of each sequence
        mine = np.zeros((K, k, seqs, t), np.float64)
        top = host(xp, self.top)
        mine[sp.rank] = top.astype(np.float64).T.reshape(k, seqs, t)
        every = sp.sum_scalars(mine).reshape(K, k, seqs, t)  # each rank's row: its own choices, the others 0
        whole = np.moveaxis(every, 0, 2).reshape(-1).astype(np.int64)   # (slot, sequence, chunk, position)
        order = np.argsort(whole, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(whole, minlength=E))])
        cap = spec.capacity(n * K)
        keep = np.zeros(whole.size, bool)
        for e in range(E):                                   # each expert's first ``cap`` in that order
            keep[order[bounds[e]:bounds[e + 1]][:cap]] = True
        keep = keep.reshape(k, seqs, K, t)[:, :, sp.rank].reshape(-1)   # this rank's: q = j * n + token
        flat = top.T.reshape(-1)
        return [xp.asarray(np.flatnonzero(keep & (flat == e))) for e in range(E)]

    def share(self, xp, sp) -> None:
        """Over ``sp`` (an SPComm: the chunks of the same sequences), the counts and probability sums of the
        whole micro-batch, for the aux loss (rank order: the same bits on every SP rank)."""
        E = self.probs.shape[1]
        sums = host(xp, self.probs.sum(axis=0)).astype(np.float64)
        total = sp.sum_scalars(np.concatenate([self.routed_host.astype(np.float64), sums, [self.n]]))
        self.whole = (xp.asarray(total[:E]), xp.asarray(total[E:2 * E]), float(total[-1]))

    def f(self):
        """f_e: the share of the routed assignments that went to e (of the whole sequences with SP)."""
        routed, _, n = self.whole if self.whole is not None else (self.routed, None, self.n)
        return routed / float(n * self.top.shape[1])

    def aux(self, E: int) -> float:
        """E · Σ_e f_e · p_e (1 when balanced), f_e over the routed assignments, p_e the mean probability."""
        p = self.probs.mean(axis=0) if self.whole is None else self.whole[1] / self.whole[2]
        return float(E * (self.f() * p).sum())


class MoEStats:
    """What the MoE blocks routed since the last ``take()``: kept tokens per (MoE block, expert), drops, and the
    aux loss summed over the forward passes."""

    def __init__(self):
        self.paused = False     # a checkpointed block's forward run again in its backward: counted once
        self.take()

    def add(self, block: int, routing: Routing, aux: float) -> None:
        if self.paused:
            return
        t = self.tokens.setdefault(block, np.zeros(len(routing.tokens), np.int64))
        t += routing.tokens
        r = self.routed.setdefault(block, np.zeros(len(routing.tokens), np.int64))
        r += routing.routed_host
        self.dropped += routing.dropped
        self.aux_sum += aux
        self.passes += 1

    def take(self):
        """(tokens {block: per expert}, dropped, aux_sum, passes) so far; starts again from nothing (``routed``
        {block: per expert}, the assignments chosen before drops, is read before)."""
        out = (getattr(self, "tokens", {}), getattr(self, "dropped", 0), getattr(self, "aux_sum", 0.0),
               getattr(self, "passes", 0))
        self.tokens, self.routed, self.dropped, self.aux_sum, self.passes = {}, {}, 0, 0.0, 0
        return out


class MoEMLP:
    """The MoE MLP on ``xp`` in ``dtype``; ``scale``: the loss scale of the pass in flight (the GPT's head sets
    it: the aux loss's gradient is of ``scale · aux_coef · aux``)."""

    def __init__(self, spec: MoESpec, xp=np, dtype=np.float32):
        self.spec, self.xp, self.dtype = spec, xp, dtype
        self.scale = 1.0
        self.stats = MoEStats()
        self.bias = {}          # block -> per-expert selection bias (bias_rate > 0), float64
        self.sp = None          # sequence parallelism: the SPComm whose chunks share the aux loss

    def update_bias(self, block: int, routed) -> None:
        """One step of aux-loss-free balancing: bias_e += γ · sign(mean load - load_e) from the step's global
        ``routed`` counts of block ``block`` (the same on every rank)."""
        routed = np.asarray(routed, np.float64)
        b = self.bias.setdefault(block, np.zeros(self.spec.experts, np.float64))
        b += self.spec.bias_rate * np.sign(routed.mean() - routed)

    def forward(self, p, m, block: int = 0, seqs: int = 1):
        """(out (n, C), cache) of rows m (n, C), ``seqs`` sequences of n / seqs positions each (sequence-major;
        with SP, this rank's chunk of each); ``p``: {short name: parameter in dtype}."""
        xp, s = self.xp, self.spec
        n, C = m.shape
        r = Routing(xp, s, softmax(xp, m @ p[ROUTER]), self.bias.get(block), self.sp, seqs)
        if self.sp is not None:
            r.share(xp, self.sp)
        self.stats.add(block, r, r.aux(s.experts))
        Y, acts = self.experts_forward(p, m, r, block)
        w = r.weights.astype(self.dtype)
        out = xp.zeros((n, C), self.dtype)
        for j in range(s.top_k):                             # combined in slot order
            out += w[:, j:j + 1] * Y[j * n:(j + 1) * n]
        shared = []
        for e in range(s.shared):                            # then the shared experts, in index order
            h, t, g, y = expert_forward(xp, p, e, m, "shared.")
            out += y
            shared.append((h, t, g))
        return out, (m, r, acts, Y, block, shared)

    def experts_forward(self, p, m, r: Routing, block: int):
        """(Y (k·n, C): each assignment's expert output, 0 where dropped; what the backward reads)."""
        s, n = self.spec, m.shape[0]
        Y = self.xp.zeros((s.top_k * n, m.shape[1]), self.dtype)
        acts = []
        for e in range(s.experts):
            q = r.kept[e]
            h, t, g, y = expert_forward(self.xp, p, e, m[q % n])
            Y[q] = y
            acts.append((h, t, g))
        return Y, acts

    def backward(self, p, cache, dout):
        """(dm (n, C), {short name: grad}) for upstream dout (n, C), the aux loss's gradient included."""
        xp, s, dt = self.xp, self.spec, self.dtype
        m, r, acts, Y, block, shared = cache
        n, C = m.shape
        k, E = s.top_k, s.experts
        w = r.weights.astype(dt)
        dY = xp.empty_like(Y)
        dw = xp.empty((n, k), dt)
        for j in range(k):
            part = Y[j * n:(j + 1) * n]
            dw[:, j] = (dout * part).sum(axis=1)
            dY[j * n:(j + 1) * n] = w[:, j:j + 1] * dout
        dm, g = self.experts_backward(p, m, r, acts, dY, block)
        if s.shared:
            g.update({name: xp.zeros(p[name].shape, dt) for name in SHARED_KEYS})
            for e in range(s.shared):                        # after the routed experts, in index order
                dm += expert_backward(p, e, m, shared[e], dout, g, e, "shared.")
        # the renormalisation w = c / Σc, then the softmax, in the probabilities' precision
        pd = r.probs.dtype
        dwn = dw.astype(pd)
        dc = (dwn - (dwn * r.weights).sum(axis=1, keepdims=True)) / r.total
        dprobs = xp.zeros((n, E), pd)
        dprobs[xp.arange(n)[:, None], r.top] = dc             # each row's k chosen experts (distinct)
        if s.aux_coef:          # with SP: f of the whole sequences; n this chunk's (the ZeRO mean over SP)
            dprobs += (self.scale * s.aux_coef * E / n) * r.f().astype(pd)
        dlogits = (r.probs * (dprobs - (dprobs * r.probs).sum(axis=1, keepdims=True))).astype(dt)
        g[ROUTER] = m.T @ dlogits
        dm += dlogits @ p[ROUTER].T
        return dm, g

    def experts_backward(self, p, m, r: Routing, acts, dY, block: int):
        """(dm (n, C) of the experts, {expert short name: grad}): the input gradients summed in expert order."""
        n = m.shape[0]
        g = {name: self.xp.zeros(p[name].shape, self.dtype) for name in EXPERT_KEYS}
        dm = self.xp.zeros(m.shape, self.dtype)
        for e in range(self.spec.experts):
            q = r.kept[e]
            tok = q % n
            dx = expert_backward(p, e, m[tok], acts[e], dY[q], g, e)
            dm[tok] += dx
        return dm, g


def expert_forward(xp, p, e: int, x, pre: str = "experts."):
    """(h, t, g, y) of expert e of ``p`` on rows x: h = x·W1 + b1, g = gelu(h) (t its tanh), y = g·W2 + b2
    (``pre``: the routed experts' names, or ``"shared."`` for the shared experts')."""
    h = x @ p[pre + "fc.w"][e] + p[pre + "fc.b"][e]
    g, t = gelu(xp, h)
    return h, t, g, g @ p[pre + "out.w"][e] + p[pre + "out.b"][e]


def expert_backward(p, e: int, x, act, dy, grads, slot, pre: str = "experts."):
    """dx of expert e of ``p`` for rows x (its forward's ``act`` = (h, t, g)) and upstream dy; its weight
    gradients written into ``grads[name][slot]``."""
    h, t, ge = act
    grads[pre + "out.w"][slot] = ge.T @ dy
    grads[pre + "out.b"][slot] = dy.sum(axis=0)
    dh = (dy @ p[pre + "out.w"][e].T) * gelu_grad(h, t)
    grads[pre + "fc.w"][slot] = x.T @ dh
    grads[pre + "fc.b"][slot] = dh.sum(axis=0)
    return dh @ p[pre + "fc.w"][e].T
