"""The GPT's pieces in plain array code, on ``xp`` (NumPy or CuPy), in any float dtype.

The reference the C kernels (gpt_fast.py) are tested against, the path of CuPy and of a
machine without a C compiler, and what the float64 finite-difference tests check. Arrays
are (batch, time, channels); every function returns new arrays.
"""
import numpy as np

_C = float(np.sqrt(2.0 / np.pi))   # a Python float: a NumPy float64 scalar would promote float32 arrays
LN_EPS = 1e-5


# ---- elementwise pieces ----------------------------------------------------------
# x * x * x, not x ** 3: NumPy's power ufunc calls libm pow, far slower.
def gelu(xp, x):
    """tanh-approximate GELU; returns (y, t) where t = tanh(...) is kept for the backward."""
    t = xp.tanh(_C * x * (1.0 + 0.044715 * (x * x)))
    return 0.5 * x * (1.0 + t), t


def gelu_grad(x, t):
    """d gelu / dx at x, given t from gelu()."""
    return 0.5 * (1.0 + t) + (0.5 * _C) * x * (1.0 - t * t) * (1.0 + 3 * 0.044715 * (x * x))


def layernorm(xp, x, g, b):
    """LayerNorm over the last axis; returns (y, cache)."""
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + LN_EPS)
    xhat = xc * rstd
    return xhat * g + b, (xhat, rstd)


def layernorm_backward(dy, cache, g):
    """(dx, dg, db) of LayerNorm for upstream dy."""
    xhat, rstd = cache
    dxhat = dy * g
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    axes = tuple(range(dy.ndim - 1))
    return dx, (dy * xhat).sum(axis=axes), dy.sum(axis=axes)


def linear(x, w, b):
    """x @ w + b on the last axis of x (one matrix multiply over all rows)."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[1],)) + b


def matmul(x, w):
    """x @ w on the last axis of x, without a bias (a row-parallel layer's partial sum under tensor parallelism)."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[1],))


def linear_backward(dy, x, w):
    """(dx, dw, db) of y = x @ w + b."""
    dx, weight = linear_backward_parts(dy, x, w)
    return (dx,) + weight()


def linear_backward_parts(dy, x, w):
    """(dx, weight) of y = x @ w + b: the input gradient now, ``weight()`` -> (dw, db) when called."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return (dy2 @ w.T).reshape(x.shape), lambda: (x2.T @ dy2, dy2.sum(axis=0))


# ---- attention ------------------------------------------------------------------------
def attention(xp, qkv, n_head):
    """Causal multi-head self-attention core on (B, T, 3C) -> (B, T, C); returns (y, cache)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hd).transpose(0, 2, 1, 3) for i in range(3))
    scale = 1.0 / float(np.sqrt(hd))
    s = (q @ k.transpose(0, 1, 3, 2)) * scale                 # (B, H, T, T)
    future = xp.triu(xp.ones((T, T), dtype=bool), k=1)
    s = xp.where(future, -xp.inf, s)
    s = s - s.max(axis=-1, keepdims=True)
    att = xp.exp(s)
    att /= att.sum(axis=-1, keepdims=True)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y, (q, k, v, att, scale)


def attention_backward(xp, dy, cache):
    """d qkv (B, T, 3C) for upstream dy (B, T, C)."""
    q, k, v, att, scale = cache
    B, H, T, hd = q.shape
    dy = dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    dv = att.transpose(0, 1, 3, 2) @ dy
    datt = dy @ v.transpose(0, 1, 3, 2)
    ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True))   # softmax backward; masked entries stay 0
    dq = (ds @ k) * scale
    dk = (ds.transpose(0, 1, 3, 2) @ q) * scale
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    return xp.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


# ---- the layers ---------------------------------------------------------------------------
class Attention:
    """The causal attention core of one block on this rank's ``n_head`` heads (gpt_sp.SPAttention:
    the same over the whole sequence of a sequence-parallel rank's chunk)."""

    def __init__(self, xp, n_head: int):
        self.xp, self.n_head = xp, n_head

    def forward(self, qkv):
        """(y (B, T, C), cache) of qkv (B, T, 3C)."""
        return attention(self.xp, qkv, self.n_head)

    def backward(self, dy, cache):
        """d qkv (B, T, 3C) of upstream dy (B, T, C)."""
        return attention_backward(self.xp, dy, cache)


class NumpyLayers:
    """A transformer block and the final LayerNorm in array code, every array new (``ws``, ``key`` unused);
    ``tp``: the TP group (a TPComm) whose all-reduces ``reduce`` runs, or None."""

    name = "numpy"

    def __init__(self, xp, n_head: int, tp=None):
        self.xp, self.n_head, self.tp = xp, n_head, tp
        self.attention = Attention(xp, n_head)

    def reduce(self, x):
        """The TP all-reduce of a row-parallel layer's partial sums or a column-parallel layer's dx (else x)."""
        return x if self.tp is None else self.tp.all_reduce(self.xp.ascontiguousarray(x))

    def ln_forward(self, x, g, b, ws=None, key=None):
        return layernorm(self.xp, x, g, b)

    def ln_backward(self, dy, cache, g, ws=None, key=None):
        return layernorm_backward(dy, cache, g)

    def block_forward(self, p, x, ws=None, key=None):
        xp = self.xp
        a, ln1 = layernorm(xp, x, p["ln1.g"], p["ln1.b"])
        y, att = self.attention.forward(linear(a, p["qkv.w"], p["qkv.b"]))
        x1 = x + (self.reduce(matmul(y, p["proj.w"])) + p["proj.b"])      # row-parallel under TP
        m, ln2 = layernorm(xp, x1, p["ln2.g"], p["ln2.b"])
        f = linear(m, p["fc.w"], p["fc.b"])
        gf, t = gelu(xp, f)
        out = x1 + (self.reduce(matmul(gf, p["out.w"])) + p["out.b"])
        return out, (ln1, a, att, y, ln2, m, f, t, gf)

    def block_backward(self, p, cache, dout, ws=None, key=None):
        """(dx, {short name: grad}) of one block."""
        dx, weights = self.block_backward_parts(p, cache, dout)
        return dx, weights()

    def block_backward_parts(self, p, cache, dout, ws=None, key=None, keep=False):
        """(dx, weights): ``weights()`` -> the linear layers' {short name: grad} later (``keep`` unused)."""
        reduce = self.reduce
        ln1, a, att, y, ln2, m, f, t, gf = cache
        g = {}
        dgf, w_out = linear_backward_parts(dout, gf, p["out.w"])
        dm, w_fc = linear_backward_parts(dgf * gelu_grad(f, t), m, p["fc.w"])
        dm = reduce(dm)
        dx1, g["ln2.g"], g["ln2.b"] = layernorm_backward(dm, ln2, p["ln2.g"])
        dx1 = dx1 + dout
        dy, w_proj = linear_backward_parts(dx1, y, p["proj.w"])
        da, w_qkv = linear_backward_parts(self.attention.backward(dy, att), a, p["qkv.w"])
        da = reduce(da)
        dx, g["ln1.g"], g["ln1.b"] = layernorm_backward(da, ln1, p["ln1.g"])

        def weights():
            for name, part in (("out", w_out), ("fc", w_fc), ("proj", w_proj), ("qkv", w_qkv)):
                g[name + ".w"], g[name + ".b"] = part()
            return g
        return dx + dx1, weights
