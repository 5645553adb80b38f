"""zerompi's built-in GPT written with PyTorch modules: one definition for the one-process benchmark
(scripts/bench_torch_gpt.py, which checks it against zerompi's float64 loss and gradients) and the
distributed one (scripts/bench_torch_dist_gpt.py, under DDP or FSDP2).

Pre-LayerNorm blocks, causal attention (``F.scaled_dot_product_attention``), tanh GELU, the head tied to
the token table; the parameters by zerompi's names (``params``), each block a module of its own (FSDP2
shards per block). Imports only torch and NumPy: it runs in an interpreter without zerompi.
"""
import numpy as np
import torch
import torch.nn.functional as F

BLOCK_KEYS = ("ln1.g", "ln1.b", "qkv.w", "qkv.b", "proj.w", "proj.b", "ln2.g", "ln2.b", "fc.w", "fc.b", "out.w",
              "out.b")
TOP_KEYS = ("wte", "wpe", "ln_f.g", "ln_f.b")


def _param(a, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(np.asarray(a, np.float32), device=device))


class Block(torch.nn.Module):
    """One transformer block; its parameters under zerompi's short names with '_' for '.'."""

    def __init__(self, params: dict, n_head: int, device=None):
        super().__init__()
        self.n_head = n_head
        for k in BLOCK_KEYS:
            self.register_parameter(k.replace(".", "_"), _param(params[k], device))

    def forward(self, h):
        q = lambda k: getattr(self, k.replace(".", "_"))  # noqa: E731
        B, T, C = h.shape
        a = F.layer_norm(h, (C,), q("ln1.g"), q("ln1.b"), 1e-5)
        qkv = a @ q("qkv.w") + q("qkv.b")
        heads = [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv.split(C, dim=-1)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).reshape(B, T, C)
        h = h + y @ q("proj.w") + q("proj.b")
        m = F.layer_norm(h, (C,), q("ln2.g"), q("ln2.b"), 1e-5)
        return h + F.gelu(m @ q("fc.w") + q("fc.b"), approximate="tanh") @ q("out.w") + q("out.b")


class TorchGPT(torch.nn.Module):
    """The GPT from zerompi's layers ``[(layer name, {parameter name: array})]``; ``model(idx, targets)`` is the
    mean cross-entropy loss."""

    def __init__(self, layers, n_head: int, device=None):
        super().__init__()
        flat = {name: a for _, p in layers for name, a in p.items()}
        self.wte, self.wpe = _param(flat["wte"], device), _param(flat["wpe"], device)
        self.ln_f_g, self.ln_f_b = _param(flat["ln_f.g"], device), _param(flat["ln_f.b"], device)
        blocks = [{k.split(".", 1)[1]: a for k, a in p.items()} for lname, p in layers if lname.startswith("block")]
        self.blocks = torch.nn.ModuleList(Block(b, n_head, device) for b in blocks)

    @property
    def params(self) -> dict:
        """{zerompi's parameter name: this model's parameter}."""
        out = {"wte": self.wte, "wpe": self.wpe, "ln_f.g": self.ln_f_g, "ln_f.b": self.ln_f_b}
        for i, b in enumerate(self.blocks):
            out.update({f"block{i}.{k}": getattr(b, k.replace(".", "_")) for k in BLOCK_KEYS})
        return out

    def forward(self, idx, targets):
        B, T = idx.shape
        h = self.wte[idx] + self.wpe[:T]
        for block in self.blocks:
            h = block(h)
        hf = F.layer_norm(h, (h.shape[-1],), self.ln_f_g, self.ln_f_b, 1e-5)
        logits = hf @ self.wte.T
        return F.cross_entropy(logits.reshape(B * T, -1).float(), targets.reshape(-1))

    loss = forward


def random_layers(vocab: int, seq_len: int, n_layer: int, d_model: int, seed: int = 0) -> list:
    """Layers of the built-in GPT's names and shapes, GPT-2 style values (N(0, 0.02), LayerNorm gains 1, biases 0)
    from a NumPy generator: for timing where zerompi's own initial values are not at hand."""
    rng, C = np.random.default_rng(seed), d_model
    normal = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)  # noqa: E731
    zeros, ones = (lambda n: np.zeros(n, np.float32)), (lambda n: np.ones(n, np.float32))
    shapes = {"ln1.g": ones(C), "ln1.b": zeros(C), "qkv.b": zeros(3 * C), "proj.b": zeros(C), "ln2.g": ones(C),
              "ln2.b": zeros(C), "fc.b": zeros(4 * C), "out.b": zeros(C)}
    layers = [("embed", {"wte": normal(vocab, C), "wpe": normal(seq_len, C)})]
    for i in range(n_layer):
        p = dict(shapes, **{"qkv.w": normal(C, 3 * C), "proj.w": normal(C, C), "fc.w": normal(C, 4 * C),
                            "out.w": normal(4 * C, C)})
        layers.append((f"block{i}", {f"block{i}.{k}": p[k] for k in BLOCK_KEYS}))
    layers.append(("ln_f", {"ln_f.g": ones(C), "ln_f.b": zeros(C)}))
    return layers
