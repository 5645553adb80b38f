"""The table ``python -m zerompi.estimate`` prints: the estimate's dict as text.

One concern: turning :func:`~zerompi.estimate.stages.estimate`'s dict into the table (model states first, then
buffers, then communication, by level when a topology was asked for) and its footer notes. No arithmetic about
memory lives here, and no options: cli.py parses them.
"""
from typing import List

from .stages import BUFFER_ROWS, OPTIMIZER_LABELS

UNITS = ((1e9, "GB", 2 ** 30, "GiB"), (1e6, "MB", 2 ** 20, "MiB"), (1e3, "kB", 2 ** 10, "KiB"), (1, "B", 1, "B"))


def _units(largest: float):
    return next(u for u in UNITS if largest >= u[0])


def format_table(est: dict) -> str:
    """The estimate as the text table the CLI prints: model states first, then buffers, then communication."""
    rows = est["stages"]
    big, unit, bin_, bunit = _units(max(r["total_bytes"] for r in rows))
    dec = lambda b: f"{b / big:12.4f}"
    binary = lambda b: f"{b / bin_:12.4f}"
    line = lambda label, cells: f"  {label:<28}" + "".join(f"{c:>14}" for c in cells)
    out = [f"zerompi.estimate: Ψ = {est['params']:,} parameters, N = {est['ranks']} ranks, {est['dtype']} storage, "
           f"{OPTIMIZER_LABELS[est.get('optimizer', 'adamw')][0]} with an fp32 master ({unit} = {big:,.0f} bytes)",
           line(f"bytes per rank, {unit}", [f"stage {r['stage']}" for r in rows])]
    for key, label in (("params_bytes", "params"), ("grads_bytes", "grads"),
                       ("optimizer_bytes", OPTIMIZER_LABELS[est.get("optimizer", "adamw")][1])):
        out.append(line(label, [dec(r[key]) for r in rows]))
    if est.get("hpz_applies"):
        out.append(line("secondary copy (hpZ)", [dec(r["secondary_bytes"]) if r["secondary_bytes"] else "-"
                                                 for r in rows]))
    out.append(line(f"model states, {unit}", [dec(r["model_state_bytes"]) for r in rows]))
    if any(est.get("offload", {}).get(k, "none") != "none" for k in ("optimizer", "params")):
        for place, label in (("device", "of them on the device"), ("host", "in host memory (offload)"),
                             ("disk", "in files (offload)")):
            out.append(line(label, [dec(r["model_state_bytes_by_place"][place]["total"]) for r in rows]))
    out.append(line(f"model states, {bunit}", [binary(r["model_state_bytes"]) for r in rows]))
    out.append(line("formula", [r["formula"] for r in rows]))
    labels = {"grad_buckets": "gradient buckets", "gathered_params": "gathered layers (stage 3)",
              "spare_buffers": "spare bucket buffers", "grad_accumulator": "micro-batch accumulator",
              "comm_scratch": "reduce-scatter scratch"}
    for key in BUFFER_ROWS:
        out.append(line(f"+ {labels[key]}", [dec(r["buffers"][key]) if r["buffers"][key] else "-" for r in rows]))
    pending = est["in_flight"]
    out.append(line(f"total ({pending:,} pending), {unit}", [dec(r["total_bytes"]) for r in rows]))
    out.append(line(f"total ({pending:,} pending), {bunit}", [binary(r["total_bytes"]) for r in rows]))
    if pending > 0:
        out.append(line(f"total (best case), {unit}", [dec(r["total_bytes_best_case"]) for r in rows]))
    act = est.get("activations")
    if act:
        out.append(line(f"+ activations (GPT), {unit}", [dec(r["activation_bytes"]) for r in rows]))
        out.append(line(f"total with activations, {unit}", [dec(r["total_bytes_with_activations"]) for r in rows]))
        out.append(line(f"total with activations, {bunit}", [binary(r["total_bytes_with_activations"]) for r in rows]))
    if est.get("by_level"):
        out += level_rows(est, line, dec, unit)
    else:
        out.append(line(f"communication per step, {unit}", [dec(r["comm_bytes_per_step"]) for r in rows]))
        if est.get("quantized"):
            out.append(line(f"  unquantized (logical), {unit}", [dec(r["comm_logical_bytes_per_step"]) for r in rows]))
        out.append(line("collective calls per step", [f"{r['comm_calls_per_step']:,}" for r in rows]))
        out.append(line("communication time, s", [f"{r['comm_seconds_per_step']:.4f}" for r in rows]))
    padding = est["padded_params"] - est["params"]
    out += ["", activation_note(act)] if act else []
    out += ["",
            f"layout: {est['buckets']:,} buckets of up to {est['bucket_numel']:,} elements ({est['bucket_mb']:g} MiB), "
            f"{padding:,} padding elements; stage-3 prefetch {est['prefetch']}; "
            f"{est['micro_batches']} micro-batch(es)",
            _pending_note(est)] + quant_notes(est)
    if est.get("by_level"):
        return "\n".join(out + level_notes(est))
    out += [f"communication: ring volumes, (N-1)/N of the buffer per pass; time = calls x (N-1) x "
            f"{est['latency_us']:g} us + bytes / {est['bandwidth_gbps']:g} Gbit/s",
            f"stage 3 moves 3 passes per micro-batch (gather forward, gather backward, reduce-scatter); the engine "
            f"keeps the buckets it holds gathered across each forward/backward turn, so it sends up to "
            f"{rows[3]['comm_bytes_kept_at_turns']:,} bytes less than that"]
    return "\n".join(out)


def activation_note(act: dict) -> str:
    """The footer line of the activations: the GPT's shape, the formula and its value."""
    how = "with activation checkpointing" if act["checkpoint"] else "without checkpointing"
    return (f"activations: the GPT's (zerompi.train's built-in, C kernels, float32) {how}: L = {act['n_layer']}, "
            f"C = {act['d_model']}, H = {act['n_head']}, T = {act['seq_len']}, V = {act['vocab']}, "
            f"B = {act['rows_per_rank']} sequences per rank per micro-batch (batch {act['batch']}); "
            f"{'n = BT, A = BHT^2: ' if act.get('sp', 1) == 1 else ''}"
            f"{act['formula']} = {act['bytes']:,} bytes per rank (docs/activations.md)")


def level_rows(est: dict, line, dec, unit: str) -> List[str]:
    """The communication rows by level: bytes sent inside and across nodes per step, and their time."""
    rows = est["stages"]
    level = lambda key, lvl: [r[key][lvl] for r in rows]
    out = [line(f"sent inside nodes / step, {unit}", [dec(b) for b in level("comm_bytes_per_step_by_level", "intra")]),
           line(f"sent across nodes / step, {unit}", [dec(b) for b in level("comm_bytes_per_step_by_level", "inter")])]
    if est.get("quantized"):
        out += [line(f"  unquantized inside, {unit}", [dec(b) for b in level("comm_logical_bytes_per_step_by_level",
                                                                             "intra")]),
                line(f"  unquantized across, {unit}", [dec(b) for b in level("comm_logical_bytes_per_step_by_level",
                                                                             "inter")])]
    out += [line("time inside nodes, s", [f"{t:.4f}" for t in level("comm_seconds_per_step_by_level", "intra")]),
            line("time across nodes, s", [f"{t:.4f}" for t in level("comm_seconds_per_step_by_level", "inter")]),
            line("communication time, s", [f"{r['comm_seconds_per_step_levels']:.4f}" for r in rows])]
    if est["nodes"] > 1:
        out += [line(f"if flat: across nodes, {unit}", [dec(b) for b in level("comm_bytes_per_step_if_flat", "inter")]),
                line("if flat: communication time, s",
                     [f"{sum(r['comm_seconds_per_step_if_flat'].values()):.4f}" for r in rows])]
    return out


def level_notes(est: dict) -> List[str]:
    """The footer of the by-level table: the topology, what hpZ applies to, the time model."""
    n, k, s = est["ranks"], est["node_size"], est["shard_size"]
    nodes = f"{est['nodes']} node{'s' if est['nodes'] > 1 else ''} of {k}"
    groups = (f"one shard group of all {n} ranks (N)" if est["shard_groups"] == 1 else
              f"{est['shard_groups']} shard groups of S = {s} ranks, replicated (model states with S in place of N; "
              f"each step all-reduces the gradient shard across the groups)")
    out = [f"topology: {n} ranks in {nodes}; {groups}"]
    if est["hpz"]:
        out.append("hpZ: applies to the stage-3 column only (stages 0-2 keep whole parameters); " +
                   ("a node-local secondary copy of 1/K of the parameters (K = node size), so only the first "
                    "forward after a step gathers across nodes" if est["hpz_applies"] else
                    "no effect here: a shard group is one node, so no gather leaves the node"))
    out.append(f"communication: the bytes the engine sends per step (engine/traffic.py): within a group across "
               f"nodes, a reduce-scatter or all-gather moves (K-1)/K of a bucket inside the node and 1/K x (M-1)/M "
               f"across; time per level = ring steps x {est['latency_us']:g} us + bytes / bandwidth "
               f"({est['intra_gbps']:g} Gbit/s inside nodes, {est['inter_gbps']:g} across), the two levels added")
    if est["nodes"] > 1:
        out.append("if flat: the same collectives flat over each shard group, unaware of nodes, as before two "
                   "levels: (S-K)/S of every bucket crosses (hpZ needs two levels: left out)")
    return out


def quant_notes(est: dict) -> List[str]:
    """The footer line of a quantized estimate: what is quantized, and how a slice travels."""
    q = est.get("quantization") or {}
    if not est.get("quantized"):
        return []
    what = [f"weights {q['weights']} (qwZ: the parameter gathers of stages 1-3)"] if q["weights"] else []
    what += [f"gradients {q['grads']} (qgZ: the reduce-scatters)"] if q["grads"] else []
    return [f"quantized: {' and '.join(what)}, blocks of {q['block']}: a slice of k elements travels as its values "
            f"(k bytes for int8, (k + 1) / 2 for int4, padded to 4) and a 4-byte scale per block; the bytes and "
            f"times above are on the wire, the unquantized rows what the same step would send unquantized "
            f"(stage 0's gradient all-gather, the all-reduce across shard groups and hpZ's gathers inside a node "
            f"travel unquantized)"]


def _pending_note(est: dict) -> str:
    """The footer line that says which bound on pending reductions the totals assume."""
    cap, pending = est["engine_max_pending"], est["in_flight"]
    if not est["overlap"]:
        return ("overlap off: every collective is waited for as it starts, so no reduction is pending when the "
                "next bucket's gradients arrive (the best case)")
    whose = (f"the engine's cap (MAX_PENDING_REDUCES = {cap})" if pending == cap
             else f"--in-flight {pending}; the engine's cap is {cap}")
    return (f"pending: gradient reductions still in flight when the next bucket's gradients arrive, at most "
            f"{pending}: {whose}; best case: none pending (each reduction done before the next bucket fills)")
