"""The GPT's parameters as Hugging Face's GPT-2 names them, and GPT-2's config.json, written and checked.

One concern: the correspondence, shared by the export (checkpoint/hf_export.py) and the import
(train/hf_init.py). zerompi's GPT is GPT-2's architecture with the same layouts: a linear layer's
weight is [in, out] as GPT-2's Conv1D keeps it, the attention's q, k, v are one fused ``c_attn``
([C, 3C], q then k then v, the heads contiguous in each), LayerNorm eps 1e-5, tanh GELU
("gelu_new"), learned positions, the output head tied to ``wte``. So each tensor is copied as it
is, only renamed. docs/interop.md.
"""
import re
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError

LN_EPS = 1e-5                         # zerompi's LayerNorm eps (models/gpt_numpy.py)
PREFIX = "transformer."               # GPT2LMHeadModel's save_pretrained names; GPT2Model's have none
BLOCK = {"ln1.g": "ln_1.weight", "ln1.b": "ln_1.bias", "qkv.w": "attn.c_attn.weight", "qkv.b": "attn.c_attn.bias",
         "proj.w": "attn.c_proj.weight", "proj.b": "attn.c_proj.bias", "ln2.g": "ln_2.weight", "ln2.b": "ln_2.bias",
         "fc.w": "mlp.c_fc.weight", "fc.b": "mlp.c_fc.bias", "out.w": "mlp.c_proj.weight", "out.b": "mlp.c_proj.bias"}
OTHER = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f.g": "ln_f.weight", "ln_f.b": "ln_f.bias"}
# Tensors a GPT-2 file may hold that are not parameters of ours: the tied head, old versions' attention masks.
IGNORED = re.compile(r"(lm_head\.weight|(h\.\d+\.attn\.(bias|masked_bias)))")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")   # both GPT-2's tanh approximation
DTYPES = {"fp32": ("F32", "float32"), "fp16": ("F16", "float16"), "bf16": ("BF16", "bfloat16")}  # ours: (st, torch)


def hf_name(name: str) -> str:
    """GPT-2's name (GPT2LMHeadModel's, with ``transformer.``) of zerompi's parameter ``name``."""
    if name in OTHER:
        return PREFIX + OTHER[name]
    m = re.fullmatch(r"block(\d+)\.(.+)", name)
    if not m or m.group(2) not in BLOCK:
        raise ConfigError(f"parameter {name!r} is not one of zerompi's GPT parameters; only a GPT exports to GPT-2")
    return f"{PREFIX}h.{m.group(1)}.{BLOCK[m.group(2)]}"


def our_names(n_layer: int) -> List[str]:
    """zerompi's GPT parameter names in the order of its layers."""
    blocks = [f"block{i}.{k}" for i in range(n_layer) for k in BLOCK]
    return ["wte", "wpe"] + blocks + ["ln_f.g", "ln_f.b"]


def shapes(vocab: int, n_positions: int, n_layer: int, d_model: int) -> Dict[str, Tuple[int, ...]]:
    """{zerompi name: shape} of a GPT of these sizes (the same shapes as GPT-2's tensors)."""
    c = d_model
    block = {"ln1.g": (c,), "ln1.b": (c,), "qkv.w": (c, 3 * c), "qkv.b": (3 * c,), "proj.w": (c, c), "proj.b": (c,),
             "ln2.g": (c,), "ln2.b": (c,), "fc.w": (c, 4 * c), "fc.b": (4 * c,), "out.w": (4 * c, c), "out.b": (c,)}
    out = {"wte": (vocab, c), "wpe": (n_positions, c)}
    out.update({f"block{i}.{k}": s for i in range(n_layer) for k, s in block.items()})
    out.update({"ln_f.g": (c,), "ln_f.b": (c,)})
    return out


def gpt2_config(vocab: int, n_positions: int, n_layer: int, n_head: int, d_model: int, dtype: str = "fp32") -> dict:
    """GPT-2's config.json for a zerompi GPT of these sizes (no dropout: zerompi trains without it)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
            "n_positions": n_positions, "n_ctx": n_positions, "n_embd": d_model, "n_layer": n_layer,
            "n_head": n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": LN_EPS,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "use_cache": True, "bos_token_id": vocab - 1, "eos_token_id": vocab - 1,
            "torch_dtype": DTYPES[dtype][1]}


def read_config(config: dict, where: str) -> Dict[str, int]:
    """{vocab, n_positions, n_layer, n_head, d_model} of a GPT-2 config.json (a dict); ConfigError naming the
    field when it is not GPT-2's architecture as zerompi's GPT has it."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {what}; zerompi's GPT imports GPT-2 (model_type gpt2) only")
    kind = config.get("model_type")
    need(kind == "gpt2", f"model_type {kind!r} is not GPT-2's")
    sizes = {}
    for ours, theirs in (("vocab", "vocab_size"), ("n_positions", "n_positions"), ("n_layer", "n_layer"),
                         ("n_head", "n_head"), ("d_model", "n_embd")):
        v = config.get(theirs)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{theirs}={v!r} must be an integer >= 1")
        sizes[ours] = v
    c = sizes["d_model"]
    need(c % sizes["n_head"] == 0, f"n_embd={c} is not divisible by n_head={sizes['n_head']}")
    act = config.get("activation_function", "gelu_new")
    need(act in TANH_GELUS, f"activation_function {act!r}: zerompi's GPT has the tanh GELU ({', '.join(TANH_GELUS)})")
    eps = config.get("layer_norm_epsilon", LN_EPS)
    need(eps == LN_EPS, f"layer_norm_epsilon {eps!r}: zerompi's LayerNorm has eps {LN_EPS:g}")
    inner = config.get("n_inner")
    need(inner in (None, 4 * c), f"n_inner {inner!r}: zerompi's MLP is 4 x n_embd = {4 * c} wide")
    for field, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("tie_word_embeddings", True), ("add_cross_attention", False)):
        got = config.get(field, want)
        need(got == want, f"{field}={got!r}: zerompi's GPT has {field}={want}")
    return sizes


def our_name(hf: str) -> Optional[str]:
    """zerompi's name of GPT-2's tensor ``hf`` (with or without ``transformer.``); None for a tensor we do not
    keep (the tied head, attention masks); ConfigError for one GPT-2 does not have."""
    bare = hf[len(PREFIX):] if hf.startswith(PREFIX) else hf
    if IGNORED.fullmatch(bare):
        return None
    for ours, theirs in OTHER.items():
        if bare == theirs:
            return ours
    m = re.fullmatch(r"h\.(\d+)\.(.+)", bare)
    inverse = {v: k for k, v in BLOCK.items()}
    if m and m.group(2) in inverse:
        return f"block{int(m.group(1))}.{inverse[m.group(2)]}"
    raise ConfigError(f"tensor {hf!r} is not one of GPT-2's; zerompi's GPT imports GPT-2 (model_type gpt2) only")
