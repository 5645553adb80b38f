"""Single-process float64 oracle: the same MLP training, written independently of the engine."""
import numpy as np

from zerompi.train.models.mlp import TeacherData, init_mlp

C = np.sqrt(2.0 / np.pi)


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(C * (x + 0.044715 * x ** 3)))


def _dgelu(x):
    t = np.tanh(C * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * C * (1 + 3 * 0.044715 * x * x)


def mlp_loss_and_grads(ws, bs, x, y):
    """MSE over every element of the whole global batch, and its gradients (float64)."""
    hs, zs = [x], []
    for i, (w, b) in enumerate(zip(ws, bs)):
        z = hs[-1] @ w + b
        zs.append(z)
        hs.append(z if i == len(ws) - 1 else _gelu(z))
    diff = hs[-1] - y
    loss = np.mean(diff ** 2)
    dy = 2.0 * diff / diff.size
    gws, gbs = [None] * len(ws), [None] * len(ws)
    for i in reversed(range(len(ws))):
        dz = dy if i == len(ws) - 1 else dy * _dgelu(zs[i])
        gws[i] = hs[i].T @ dz
        gbs[i] = dz.sum(0)
        dy = dz @ ws[i].T
    return loss, gws, gbs


def train_reference(width, depth, seed, steps, batch, lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, clip=0.0,
                    stored=None, no_decay=()):
    """AdamW (decoupled decay, bias correction) with global-norm clipping, all float64.

    ``stored``: a dtype the model sees its parameters in (rounded to it from float64 through
    float32 before each forward), as an engine storing parameters in that dtype shows them.
    ``no_decay``: names of the parameters that take no weight decay.
    Returns (losses, {param name: final array}).
    """
    layers = init_mlp(width, depth, seed)
    ws = [p[f"block{i}.weight"].astype(np.float64) for i, (_, p) in enumerate(layers)]
    bs = [p[f"block{i}.bias"].astype(np.float64) for i, (_, p) in enumerate(layers)]
    params = ws + bs
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    data = TeacherData(width, depth, seed)
    losses = []
    for t in range(1, steps + 1):
        x, y = data.global_batch(t - 1, batch)
        seen = [p if stored is None else p.astype(np.float32).astype(stored).astype(np.float64) for p in params]
        loss, gws, gbs = mlp_loss_and_grads(seen[:depth], seen[depth:], x.astype(np.float64), y.astype(np.float64))
        losses.append(loss)
        grads = gws + gbs
        norm = np.sqrt(sum(np.sum(g * g) for g in grads))
        coef = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
        names = [f"block{i}.weight" for i in range(depth)] + [f"block{i}.bias" for i in range(depth)]
        for name, p, g, mi, vi in zip(names, params, grads, m, v):
            g = g * coef
            mi[...] = beta1 * mi + (1 - beta1) * g
            vi[...] = beta2 * vi + (1 - beta2) * g * g
            mhat = mi / (1 - beta1 ** t)
            vhat = vi / (1 - beta2 ** t)
            p -= lr * (mhat / (np.sqrt(vhat) + eps) + (0.0 if name in no_decay else wd) * p)
    out = {}
    for i in range(depth):
        out[f"block{i}.weight"] = ws[i]
        out[f"block{i}.bias"] = bs[i]
    return losses, out
