"""The mixture of experts before launch: the GPT's dense and expert parameters, their model states per rank, and
the expert-parallel all-to-all's bytes per step (the formulas a run prints beside what it measured).

An MoE block keeps the dense block's attention and LayerNorms (4C² + 8C) and adds the router (C·E); its E
experts hold E(2CH + H + C), its S shared experts (--shared-experts) S(2CH + H + C) more dense parameters.
Under --ep K the dense parameters are sharded over the N ranks, each EP rank's
E/K experts over the N/K ranks holding the same experts (engine/memory.py's theory_bytes for each). The
all-to-all (train/moe/routing.py's row): per MoE block and micro-batch, the counts once and four passes of the rows
that leave the rank, balanced and dropless. With --tp T a TP rank holds the attention's split share and the rest
whole (block_sizes), ZeRO over the N/T data-parallel ranks; with --pp each stage's chunks' engines (pipeline_moe).
docs/moe.md.
"""
from typing import Dict, List, Optional, Tuple

from ..engine.memory import theory_bytes
from ..errors import check


def gpt_moe_params(vocab: int, seq_len: int, d_model: int, n_layer: int, experts: int, hidden: int,
                   every: int = 1, shared: int = 0) -> Tuple[int, int]:
    """(dense Ψ, expert Ψ over all experts) of the built-in GPT with an MoE MLP in every ``every``-th block
    (``shared``: its always-on shared experts, dense parameters)."""
    c = d_model
    moe = sum(1 for i in range(n_layer) if (i + 1) % every == 0)
    dense = vocab * c + seq_len * c + 2 * c + (n_layer - moe) * (12 * c * c + 13 * c) \
        + moe * (4 * c * c + 8 * c + c * experts + shared * (2 * c * hidden + hidden + c))
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


# the estimate's MoE options besides --experts and --ep
MOE_FLAGS = ("top_k", "moe_every", "expert_hidden", "shared_experts")


def check_moe(experts: int, ep: int, top_k: int, every: int, hidden: Optional[int], ranks: int,
              other: Dict[str, bool], with_ep: Dict[str, bool], shared: int = 0) -> None:
    """ConfigError (one line) where zerompi.train's MoE refuses the values or the flags (train/moe/config.py):
    ``other`` maps each flag the MoE does not compose with yet to whether it is given, ``with_ep`` those that
    --ep K > 1 does not."""
    check(experts >= 1, f"experts={experts} must be an integer >= 1 (leave --experts out for the dense GPT)")
    check(top_k >= 1, f"top_k={top_k} must be an integer >= 1")
    check(top_k <= experts, f"top_k={top_k} is more than experts={experts}; use a top_k of at most {experts}")
    check(every >= 1, f"moe_every={every} must be an integer >= 1")
    check(hidden is None or hidden >= 1, f"expert_hidden={hidden} must be an integer >= 1")
    check(shared >= 0, f"shared_experts={shared} must be an integer >= 0 (0 = none)")
    check(ep >= 1, f"ep={ep} must be an integer >= 1")
    check(experts % ep == 0, f"experts={experts} is not divisible by ep={ep}; each expert-parallel rank holds "
                             f"experts / ep of them, so use a divisor of {experts}")
    for name, given in other.items():
        check(not given, f"{name} with --experts {experts}{' --ep ' + str(ep) if name == '--pp' else ''} is not "
                         "estimated yet (the run takes it: docs/moe.md); drop one of the two")
    for name, given in with_ep.items():
        check(ep == 1 or not given, f"{name} with --ep {ep} is not supported yet (docs/moe.md); drop one of the two")
    check(ranks % ep == 0, f"ep={ep} does not divide the {ranks} ranks; the ranks form groups of ep that hold all "
                           f"the experts, so use a divisor of {ranks}")


def block_sizes(c: int, n_layer: int, experts: int, mlp: int, every: int, shared: int, ep: int,
                tp: int = 1) -> List[int]:
    """The elements of each block on one TP rank of ``tp``, without the routed experts at --ep K > 1 (the expert
    engine's): a dense block's 12C² + 7C split over the TP ranks and 6C whole (tp_bytes.py); an MoE block's
    attention 4C² + 3C split and 5C whole (its LayerNorms and the projection's bias), its router C·E, shared
    experts and (at --ep 1) routed experts whole on every TP rank (train/moe/block.py)."""
    return [(4 * c * c + 3 * c) // tp + 5 * c + c * experts + shared * mlp + (experts * mlp if ep == 1 else 0)
            if (i + 1) % every == 0 else (12 * c * c + 7 * c) // tp + 6 * c for i in range(n_layer)]


def moe_tp_bytes(tp: int, blocks: int, n_layer: int, rows: int, t: int, c: int, micro_batches: int,
                 checkpointed: bool = False) -> int:
    """The TP all-reduce bytes one rank sends per step in the MoE GPT: per micro-batch 4 per dense block and 2 per
    MoE block (its attention's; the experts are whole), 6 and 3 with activation checkpointing, each of
    rows·T·C float32 values of which 2(K-1)/K leave the rank (tp_bytes.py)."""
    calls = (6 if checkpointed else 4) * (n_layer - blocks) + (3 if checkpointed else 2) * blocks
    return micro_batches * calls * 2 * (tp - 1) * (rows * t * c // tp) * 4


def gpt_moe(dims: dict, ranks: int, experts: int, ep: int, top_k: int, every: int, hidden: Optional[int],
            micro_batches: int, itemsize: int, shared: int = 0, tp: int = 1) -> dict:
    """The MoE section of the estimate for the GPT of ``dims`` (activations.GPT_FLAGS) over ``ranks``: its dense
    and expert parameters, each stage's dense and expert model states per rank, the all-to-all's bytes per rank
    per step, and the engine layers the ZeRO table takes (the whole model at --ep 1, one engine; the dense
    engine's at --ep K > 1: the experts are the second engine's). With ``tp`` T > 1 the ranks are T-rank TP groups
    (train/moe/expert_parallel.py): the dense engine holds a TP rank's share (block_sizes) over the N/T
    data-parallel ranks, the expert engine its EP rank's E/K experts whole over the N/(T·K) ranks holding them."""
    c, n_layer, hidden = dims["d_model"], dims["n_layer"], hidden or 4 * dims["d_model"]
    dense, expert = gpt_moe_params(dims["vocab"], dims["seq_len"], c, n_layer, experts, hidden, every, shared)
    blocks = sum(1 for i in range(n_layer) if (i + 1) % every == 0)
    mlp = 2 * c * hidden + hidden + c                   # one expert's (routed or shared)
    layers = [dims["vocab"] * c + dims["seq_len"] * c] + \
        block_sizes(c, n_layer, experts, mlp, every, shared, ep, tp) + [2 * c]
    dp = ranks // tp                                    # the data-parallel ranks: ZeRO's, and the EP groups'
    local = sum(layers) - (0 if ep > 1 else expert)     # the dense engine's parameters on one TP rank
    tokens = dims["batch"] // (dp * micro_batches) * dims["seq_len"]
    rows = []                 # the formulas (engine/memory.py's theory_bytes, unpadded), as the run prints them
    for stage in range(4):
        st = moe_states(stage, itemsize, dp, ep, local, expert)
        rows.append({"stage": stage, "dense_bytes": st["dense"]["total"], "expert_bytes": st["experts"]["total"],
                     "model_state_bytes": st["dense"]["total"] + st["experts"]["total"]})
    out = {"experts": experts, "shared_experts": shared, "ep": ep, "top_k": top_k, "moe_every": every,
           "expert_hidden": hidden,
           "moe_blocks": blocks, "dense_params": dense, "expert_params": expert, "ranks": dp,
           "expert_ranks": dp // ep, "tokens_per_micro_batch": tokens, "stages": rows,
           "all_to_all_bytes_per_step": all_to_all_bytes(ep, experts, top_k, c, tokens, blocks, micro_batches),
           "table_params": sum(layers), "table_largest_layer": max(layers), "table_layers": layers, "tp": tp}
    if tp > 1:
        out.update(dense_params_per_tp_rank=local, tp_bytes_per_step=moe_tp_bytes(
            tp, blocks, n_layer, dims["batch"] // (dp * micro_batches), dims["seq_len"], c, micro_batches))
    return out


def expert_topology(ranks: int, ep: int, node_size: Optional[int], shard_size: Optional[int]):
    """(node_size, shard_size, per_node) of the expert engine's N/K ranks, for nodes of ``node_size`` and shard groups
    of ``shard_size`` data-parallel ranks (None: all): the expert-data-parallel ranks j + K·g sit P/K to a node
    where an EP group fits in a node of P, one to a node where it spans whole nodes (``per_node`` = P: its
    sources are summed node by node first; comm/sources_reduce.py). AgreedConfigError (one line) where an EP
    group cuts a node or does not fit a shard group."""
    from ..errors import AgreedConfigError
    p, s = min(node_size or ranks, ranks), shard_size or ranks
    if not (p % ep == 0 or ep % p == 0):
        raise AgreedConfigError(f"--ep {ep} with nodes of {p} ranks: an EP group must fit in a node or span whole "
                                "nodes; use an --ep that divides or is a multiple of the node size")
    if s % ep:
        raise AgreedConfigError(f"--ep {ep} with --shard-size {shard_size}: an EP group must fit in a shard group; "
                                f"use an --ep dividing {s}")
    if p == ranks:
        return s // ep, s // ep, None
    if ep < p:
        return p // ep, s // ep, None
    return 1, s // ep, p


def with_layouts(moe: dict, est: dict, opts: dict, topo: Optional[dict] = None) -> dict:
    """At --ep K > 1, each stage's dense and expert states with the engines' padding, and each engine's ZeRO bytes
    per step: the dense engine's are the table's (``est``), the expert engine's its own estimate (one layer of E/K
    experts per MoE block over N/K, in the nodes and shard groups ``topo`` gives it: expert_topology) with each
    reduce-scatter sending the K sources' partials (comm/sources_reduce.py)."""
    if moe["ep"] == 1:
        return moe
    from .stages import estimate
    topo = topo or {}
    k = moe["ep"]
    node, shard, per_node = expert_topology(moe["ranks"], k, topo.get("node_size"), topo.get("shard_size"))
    psi = moe["expert_params"] // k
    experts = estimate(psi, moe["expert_ranks"], est["dtype"], layers=moe["moe_blocks"], **opts,
                       **({} if moe["expert_ranks"] == 1 else {"node_size": node, "shard_size": shard}),
                       **({"hpz": True} if topo.get("hpz") else {}))
    from ..engine.config import ZeroConfig
    from .plan import plan_buckets
    plan = plan_buckets(psi, moe["expert_ranks"] // (moe["expert_ranks"] // shard), experts["bucket_numel"],
                        moe["moe_blocks"], None, ZeroConfig.align * (moe["expert_ranks"] // shard))
    extra = sources_bytes(plan.lengths(), ZeroConfig(dtype=est["dtype"]).itemsize, moe["expert_ranks"], k,
                          opts.get("micro_batches", 1), node, shard, per_node)
    sent = lambda row: sum(row["comm_bytes_per_step_by_level"].values())   # noqa: E731 (what the engine sends)
    rows = [dict(r, dense_padded_bytes=d["model_state_bytes"], expert_padded_bytes=e["model_state_bytes"],
                 dense_comm_bytes_per_step=sent(d), expert_comm_bytes_per_step=sent(e) + extra,
                 expert_comm_bytes_kept_at_turns=e["comm_bytes_kept_at_turns"])
            for r, d, e in zip(moe["stages"], est["stages"], experts["stages"])]
    return dict(moe, stages=rows)


def sources_bytes(lengths: Dict[int, int], itemsize: int, ranks: int, sources: int, micro_batches: int,
                  node_size: Optional[int] = None, shard_size: Optional[int] = None,
                  per_node: Optional[int] = None) -> int:
    """Bytes per step an expert engine's reduce-scatters send beyond one partial each (engine/traffic.py's
    sources_bytes_by_level, both levels); ``lengths``: {bucket elements: buckets}."""
    from ..engine.traffic import sources_bytes_by_level
    return sum(sources_bytes_by_level(lengths, itemsize, ranks, sources, micro_batches, node_size, shard_size,
                                      per_node).values())


def format_moe(moe: dict) -> str:
    """The MoE section the command line prints under the table."""
    line = lambda label, cells: f"  {label:<28}" + "".join(f"{c:>14}" for c in cells)
    rows, k = moe["stages"], moe["ep"]
    shared = f" + {moe['shared_experts']} shared" if moe.get("shared_experts") else ""
    out = ["", f"mixture of experts: {moe['experts']} experts{shared} (top-{moe['top_k']}, hidden "
               f"{moe['expert_hidden']}) in "
               f"{moe['moe_blocks']} of the blocks, --ep {k}: Ψ = {moe['dense_params']:,} dense + "
               f"{moe['expert_params']:,} expert parameters" +
               (f"; --tp {moe['tp']}: a TP rank's dense share {moe['dense_params_per_tp_rank']:,}, its experts whole"
                if moe.get("tp", 1) > 1 else ""),
           line("bytes per rank", [f"stage {r['stage']}" for r in rows]),
           line(f"dense states (over {moe['ranks']})", [f"{r['dense_bytes']:,}" for r in rows]),
           line(f"expert states (E/K over {moe['expert_ranks']})", [f"{r['expert_bytes']:,}" for r in rows]),
           line("model states", [f"{r['model_state_bytes']:,}" for r in rows])]
    if k > 1:
        out += [line("dense, padded layout", [f"{r['dense_padded_bytes']:,}" for r in rows]),
                line("experts, padded layout", [f"{r['expert_padded_bytes']:,}" for r in rows]),
                line("dense ZeRO bytes per step", [f"{r['dense_comm_bytes_per_step']:,}" for r in rows]),
                line("expert ZeRO bytes per step", [f"{r['expert_comm_bytes_per_step']:,}" for r in rows])]
    out += [f"  all-to-all per rank per step: {moe['all_to_all_bytes_per_step']:,} bytes = {moe['moe_blocks']} MoE "
            f"blocks x micro-batches x ((K-1)·E/K·8 + 4 x n·k·(K-1)/K x C x 4 B), n = "
            f"{moe['tokens_per_micro_batch']} tokens, K = {k} (balanced, dropless; docs/moe.md)",
            "  model states: the formulas (unpadded, as a run prints them); ZeRO bytes: each engine's step (the "
            "expert reduce-scatters carry K sources' partials; stage 3 keeps a bucket at the turn: the table's note); "
            "the table above: " +
            ("the whole model, one engine over the N ranks" if k == 1 else
             "the dense engine over the N ranks (the experts: a second engine)") +
            "; activations are not estimated for the MoE GPT"]
    return "\n".join(out)


def pipeline_moe(dims: dict, ranks: int, chunks_of: Dict[int, List[int]], experts: int, ep: int, every: int,
                 hidden: Optional[int], shared: int, dtype: str, opts: dict, topo: Optional[dict] = None,
                 top_k: int = 2, tp: int = 1) -> dict:
    """--pp P with --experts E --ep K: each pipeline stage's model states per rank, its chunks' engines apart, their
    ZeRO bytes per step and its ranks' all-to-all. The stages are N/P ranks each (comm/mesh.py), stage s holds chunks
    ``chunks_of[s]`` (train/models/chunks.py's layers: the embeddings on the first, the final LayerNorm on the last);
    each chunk has a dense engine (its layers without the experts, a TP rank's share of them with ``tp`` T > 1:
    block_sizes, over the stage's N/(P·T) data-parallel ranks) and, where it holds MoE blocks and K > 1, an expert
    engine (this EP rank's E/K experts of each, whole, one layer per block, over the stage's N/(P·T·K)
    expert-data-parallel ranks, each reduce-scatter carrying the K sources' partials: train/moe/stage_experts.py).
    Per ZeRO stage: the formulas (theory_bytes, unpadded) and the engines' padded layouts (the engine's buckets of
    each chunk's layers: what the run measures), summed over the stage's engines, where offload puts them, their
    ZeRO bytes per step (each chunk's engine reduces per micro-batch: --pp-grad-reduce micro-batch, the run's
    default), and the pipeline stage whose ranks hold the most. ``topo``: the world's ``node_size``, ``shard_size``
    (ranks) and ``hpz``: a node inside a stage or holding whole stages, a shard group inside a stage (comm/mesh.py);
    the dense engines in the stage's nodes and shard groups, the expert engines in theirs (expert_topology), their
    bytes per level as an unpipelined run's (with --tp: nodes of whole stages only). The all-to-all: a rank of
    stage s exchanges for its own MoE blocks only (balanced, dropless: all_to_all_bytes)."""
    from collections import Counter
    from ..engine.config import ZeroConfig
    from .plan import layer_layout
    from .levels import check_levels
    from .stages import estimate
    c, n_layer, vocab, seq = dims["d_model"], dims["n_layer"], dims["vocab"], dims["seq_len"]
    hidden, pp = hidden or 4 * c, len(chunks_of)
    chunks = sum(len(v) for v in chunks_of.values())
    check(n_layer % chunks == 0, f"n_layer={n_layer} is not divisible into {chunks} equal chunks of blocks; use a "
                                 f"multiple of {chunks}")
    check(ranks % pp == 0, f"pp={pp} does not divide ranks={ranks}; each stage holds ranks/pp of them")
    check((ranks // pp) % tp == 0, f"tp={tp} does not divide the {ranks // pp} ranks of each pipeline stage ({ranks} "
                                   f"ranks / pp {pp}); use a divisor of {ranks // pp}")
    dp = ranks // pp // tp
    check(dp % ep == 0, f"ep={ep} does not divide the {dp} data-parallel ranks of each pipeline stage ({ranks} ranks "
                        f"/ pp {pp}" + (f" / tp {tp}" if tp > 1 else "") + f"); use a divisor of {dp}")
    mb = opts.get("micro_batches", 1)
    check(dims["batch"] % (dp * mb) == 0, f"batch={dims['batch']} does not split over {dp} data-parallel ranks x "
                                          f"{mb} micro-batches")
    mlp, per = 2 * c * hidden + hidden + c, n_layer // chunks
    moe = lambda i: (i + 1) % every == 0                                          # noqa: E731
    sizes = block_sizes(c, n_layer, experts, mlp, every, shared, ep, tp)
    itemsize, bucket_mb = ZeroConfig(dtype=dtype).itemsize, opts.get("bucket_mb", ZeroConfig.bucket_mb)
    keep = {k: v for k, v in opts.items() if k != "bucket_mb"}
    tokens = dims["batch"] // (dp * mb) * seq                       # a data-parallel rank's micro-batch

    topo = topo or {}
    inside = topo.get("node_size") is not None and topo["node_size"] < ranks // pp     # a node inside a stage
    for name, given in (("--node-size", inside), ("--shard-size", bool(topo.get("shard_size"))),
                        ("--hpz", bool(topo.get("hpz")))):
        check(tp == 1 or not given, f"{name} with --pp {pp} --tp {tp} --experts {experts} is not estimated yet (only "
                                    "nodes of whole stages: docs/moe.md); drop one of them")
    node, shard, hpz = stage_topology(ranks, pp, topo)
    node = None if tp > 1 else node     # with --tp: nodes of whole stages, each data-parallel group in one
    levels, per_node = {dp: check_levels(dp, node, shard, hpz)}, None
    if ep > 1:
        e_node, e_shard, per_node = expert_topology(dp, ep, node, shard)
        levels[dp // ep] = check_levels(dp // ep, e_node, e_shard, hpz) if dp > ep else \
            check_levels(1, None, None, hpz)
        per_node = per_node if dp > ep else None

    def engine(sizes, world):           # (the engine's padded estimate, its Ψ, its Levels) of layers of ``sizes``
        lv = levels[world]
        layout = layer_layout(sizes, lv.shard_size, lv.replicas, dtype, bucket_mb)
        est = estimate(dtype=dtype, layout=layout, ranks=world, node_size=lv.node_size, shard_size=lv.shard_size,
                       hpz=hpz, **keep)
        return dict(est, lengths=Counter(b.numel for b in layout.buckets)), sum(sizes), lv

    def formula(z, psi, lv):            # the engine's memory_report "theory": over its shard group, hpZ's copy
        return theory_bytes(z, psi, lv.shard_size, itemsize,
                            secondary=psi / lv.k if z == 3 and lv.hpz_applies else 0)["total"]

    stages = []
    for s in range(pp):
        dense, expert = [], []
        blocks = [i for ch in chunks_of[s] for i in range(ch * per, (ch + 1) * per)]
        for ch in chunks_of[s]:
            mine = range(ch * per, (ch + 1) * per)
            dense.append(engine(([vocab * c + seq * c] if ch == 0 else []) + [sizes[i] for i in mine] +
                                ([2 * c] if ch == chunks - 1 else []), dp))
            if ep > 1 and any(moe(i) for i in mine):
                expert.append(engine([experts // ep * mlp for i in mine if moe(i)], dp // ep))
        sources = sum(sources_bytes(est["lengths"], itemsize, dp // ep, ep, mb, lv.node_size, lv.shard_size, per_node)
                      for est, _, lv in expert)
        rows = []
        for z in range(4):
            d = sum(formula(z, psi, lv) for _, psi, lv in dense)
            e = sum(formula(z, psi, lv) for _, psi, lv in expert)
            dpad = sum(est["stages"][z]["model_state_bytes"] for est, _, _ in dense)
            epad = sum(est["stages"][z]["model_state_bytes"] for est, _, _ in expert)
            places = {p: sum(est["stages"][z]["model_state_bytes_by_place"][p]["total"] for est, _, _ in dense + expert)
                      for p in ("device", "host", "disk")}    # where offload puts them (all on the device without)
            comm = {name: sum(est["stages"][z]["comm_bytes_per_step"] for est, _, _ in engines)
                    for name, engines in (("dense", dense), ("expert", expert))}
            kept = sum(est["stages"][z]["comm_bytes_kept_at_turns"] for est, _, _ in dense + expert)
            rows.append({"stage": z, "dense_bytes": d, "expert_bytes": e, "model_state_bytes": d + e,
                         "dense_padded_bytes": dpad, "expert_padded_bytes": epad, "padded_bytes": dpad + epad,
                         "padded_bytes_by_place": places,
                         "dense_comm_bytes_per_step": comm["dense"],
                         "expert_comm_bytes_per_step": comm["expert"] + sources,
                         "comm_bytes_per_step": comm["dense"] + comm["expert"] + sources,
                         "comm_bytes_kept_at_turns": kept})
        n_moe = sum(1 for i in blocks if moe(i))
        stages.append({"pipeline_stage": s, "chunks": list(chunks_of[s]), "dense_params": sum(p for _, p, _ in dense),
                       "expert_params": sum(p for _, p, _ in expert), "ranks": dp, "expert_ranks": dp // ep,
                       "moe_blocks": n_moe, "zero_stages": rows,
                       "all_to_all_bytes_per_step": all_to_all_bytes(ep, experts, top_k, c, tokens, n_moe, mb),
                       "tp_bytes_per_step": moe_tp_bytes(tp, n_moe, len(blocks), tokens // seq, seq, c, mb),
                       # each engine's padded shard (elements): the replicas' files
                       "shard_numel": [est["padded_params"] // est["shard_size"] for est, _, _ in dense + expert]})
    largest = [max(range(pp), key=lambda s: (stages[s]["zero_stages"][z]["padded_bytes"], -s)) for z in range(4)]
    return {"pp": pp, "ep": ep, "tp": tp, "experts": experts, "top_k": top_k, "chunks_per_stage": chunks // pp,
            "tokens_per_micro_batch": tokens, "pipeline_stages": stages, "largest_stage": largest}


def stage_topology(ranks: int, pp: int, topo: dict):
    """(node_size, shard_size, hpz) of one pipeline stage's N/P ranks for the world's ``topo`` (node_size and
    shard_size in ranks, or absent): a node inside a stage or holding whole stages (then the stage is one node), a
    shard group inside a stage; ConfigError (one line) else, in comm/mesh.py's words."""
    dp, node, shard = ranks // pp, topo.get("node_size"), topo.get("shard_size")
    check(node is None or dp % node == 0 or node % dp == 0,
          f"node_size={node} with pp={pp}: a node must lie inside one pipeline stage of {dp} ranks or hold whole "
          f"stages; use a divisor or a multiple of {dp}")
    check(shard is None or dp % shard == 0, f"shard_size={shard} with pp={pp}: a shard group must lie inside one "
                                            f"pipeline stage of {dp} ranks; use a divisor of {dp}")
    return (None if node is None else min(node, dp)), shard, bool(topo.get("hpz"))


def format_pipeline_moe(pm: dict) -> str:
    """The per-stage MoE table the command line prints with --pp."""
    line = lambda label, cells: f"  {label:<34}" + "".join(f"{c:>14}" for c in cells)   # noqa: E731
    out = ["", f"mixture of experts in {pm['pp']} pipeline stages ({pm['chunks_per_stage']} chunk(s) each), "
               f"{pm['experts']} experts, --ep {pm['ep']}" + (f" --tp {pm['tp']}" if pm.get("tp", 1) > 1 else "") +
               ": model states per rank of each stage's engines",
           line("bytes per rank", [f"stage {z}" for z in range(4)])]
    for st in pm["pipeline_stages"]:
        rows, s = st["zero_stages"], st["pipeline_stage"]
        out += [line(f"pp stage {s}: dense (over {st['ranks']})", [f"{r['dense_bytes']:,}" for r in rows]),
                line(f"pp stage {s}: experts (over {st['expert_ranks']})", [f"{r['expert_bytes']:,}" for r in rows]),
                line(f"pp stage {s}: padded layouts", [f"{r['padded_bytes']:,}" for r in rows])]
        if any(r["padded_bytes_by_place"]["device"] != r["padded_bytes"] for r in rows):      # offloaded
            out += [line(f"pp stage {s}:   on the {p}", [f"{r['padded_bytes_by_place'][p]:,}" for r in rows])
                    for p in ("device", "host", "disk")]
        out.append(line(f"pp stage {s}: ZeRO bytes per step", [f"{r['comm_bytes_per_step']:,}" for r in rows]))
    out.append(line("the largest pipeline stage", [str(s) for s in pm["largest_stage"]]))
    out.append("  all-to-all per rank per step: " + ", ".join(
        f"pp stage {st['pipeline_stage']} {st['all_to_all_bytes_per_step']:,} bytes ({st['moe_blocks']} MoE blocks)"
        for st in pm["pipeline_stages"]) + f"; n = {pm['tokens_per_micro_batch']} tokens a micro-batch, K = "
        f"{pm['ep']} (balanced, dropless)")
    if pm.get("tp", 1) > 1:
        out.append("  TP all-reduce per rank per step: " + ", ".join(
            f"pp stage {st['pipeline_stage']} {st['tp_bytes_per_step']:,} bytes" for st in pm["pipeline_stages"]) +
            " (4 per dense block, 2 per MoE block and micro-batch, 2(K-1)/K of rows·T·C x 4 B each)")
    out.append("  formulas: each engine's theory_bytes (unpadded), as a run prints them; padded: the engines' buckets "
               "(what a run holds); ZeRO bytes: the stage's engines' step, reduced per micro-batch (the expert "
               "reduce-scatters carry K sources' partials; stage 3 keeps a bucket at the turn: the table's note); "
               "chunk 0 holds the embeddings, the last chunk the final LayerNorm (docs/moe.md)")
    return "\n".join(out)
