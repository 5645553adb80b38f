"""A float64 single-process MoE GPT, written independently of zerompi's models: forward and loss only, a token
at a time through the router and its experts (for finite differences and as the value the model must give).

Parameters are a flat {name: array} dict with zerompi's names (block{i}.router.w, block{i}.experts.fc.w (E, C, H),
...), so that the same values go through both. The loss is the mean token cross-entropy plus aux_coef times the
sum over MoE blocks of E · Σ_e f_e · p_e. Shared experts (``block{i}.shared.fc.w`` (S, C, H), ...) run on every
token, unweighted.
"""
import math

import numpy as np

GELU_C = math.sqrt(2.0 / math.pi)


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))


def layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def causal_attention(x, wqkv, bqkv, n_head):
    T, C = x.shape
    hd = C // n_head
    qkv = x @ wqkv + bqkv
    out = np.zeros((T, C))
    for h in range(n_head):
        q, k, v = (qkv[:, i * C + h * hd:i * C + (h + 1) * hd] for i in range(3))
        s = q @ k.T / math.sqrt(hd)
        s[np.triu_indices(T, 1)] = -np.inf
        a = np.exp(s - s.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        out[:, h * hd:(h + 1) * hd] = a @ v
    return out


def moe_mlp(x, p, pre, experts, top_k, capacity_factor=None, bias=None, shared=0):
    """(out (n, C), aux) of rows x (n, C): each token's top-k experts by probability (plus ``bias``, for the choice
    only; ties: lower index), weights renormalised; with a capacity, assignments kept first-come in (slot, token)
    order; plus, for every token, each of the ``shared`` always-on experts (``shared.*``) at weight 1."""
    n = x.shape[0]
    logits = x @ p[pre + "router.w"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    b = np.zeros(experts) if bias is None else bias
    choice = [sorted(range(experts), key=lambda e: (-(probs[t, e] + b[e]), e))[:top_k] for t in range(n)]
    cap = None if capacity_factor is None else max(1, math.ceil(capacity_factor * n * top_k / experts))
    used = [0] * experts
    keep = {}
    for j in range(top_k):
        for t in range(n):
            e = choice[t][j]
            keep[t, j] = cap is None or used[e] < cap
            used[e] += 1
    out = np.zeros_like(x)
    for t in range(n):
        total = sum(probs[t, e] for e in choice[t])
        for j, e in enumerate(choice[t]):
            if keep[t, j]:
                h = gelu(x[t] @ p[pre + "experts.fc.w"][e] + p[pre + "experts.fc.b"][e])
                out[t] += probs[t, e] / total * (h @ p[pre + "experts.out.w"][e] + p[pre + "experts.out.b"][e])
        for s in range(shared):
            h = gelu(x[t] @ p[pre + "shared.fc.w"][s] + p[pre + "shared.fc.b"][s])
            out[t] += h @ p[pre + "shared.out.w"][s] + p[pre + "shared.out.b"][s]
    f = np.array([sum(1 for t in range(n) if e in choice[t]) for e in range(experts)]) / (n * top_k)
    return out, experts * float((f * probs.mean(0)).sum())


def loss(p, idx, targets, n_layer, n_head, moe_blocks, experts, top_k, capacity_factor=None, aux_coef=0.01,
         bias=None, shared=0):
    """(cross-entropy, aux sum, total) of the batch idx (B, T) -> targets (B, T)."""
    B, T = idx.shape
    xs = [p["wte"][idx[b]] + p["wpe"][:T] for b in range(B)]
    aux_total = 0.0
    for i in range(n_layer):
        pre = f"block{i}."
        xs = [x + causal_attention(layer_norm(x, p[pre + "ln1.g"], p[pre + "ln1.b"]), p[pre + "qkv.w"],
                                   p[pre + "qkv.b"], n_head) @ p[pre + "proj.w"] + p[pre + "proj.b"] for x in xs]
        ms = [layer_norm(x, p[pre + "ln2.g"], p[pre + "ln2.b"]) for x in xs]
        if i in moe_blocks:          # the router sees the whole micro-batch's tokens at once (capacity, aux)
            out, aux = moe_mlp(np.concatenate(ms), p, pre, experts, top_k, capacity_factor, (bias or {}).get(i),
                               shared)
            aux_total += aux
            xs = [x + out[b * T:(b + 1) * T] for b, x in enumerate(xs)]
        else:
            xs = [x + gelu(m @ p[pre + "fc.w"] + p[pre + "fc.b"]) @ p[pre + "out.w"] + p[pre + "out.b"]
                  for x, m in zip(xs, ms)]
    ce = 0.0
    for b, x in enumerate(xs):
        logits = layer_norm(x, p["ln_f.g"], p["ln_f.b"]) @ p["wte"].T
        z = logits - logits.max(1, keepdims=True)
        lse = np.log(np.exp(z).sum(1))
        ce += float((lse - z[np.arange(T), targets[b]]).sum())
    ce /= B * T
    return ce, aux_total, ce + aux_coef * aux_total
