"""The table scripts/gpu_check.sh prints last: every GPU check, passed or not, from its files.

    python scripts/gpu_summary.py OUT        # OUT: gpu_check.sh's result folder

Reads OUT/status.txt (one "name exit seconds" line per step; exit -1: not run, the time
budget was spent), OUT/env.json, the parity runs' metrics (OUT/parity_{gpu,cpu}_n{N}_{dtype}_s{stage}.json),
OUT/bench_adam.json, OUT/bench_comm.json, OUT/bench_nccl.json, OUT/gpt.json, OUT/gpt_nccl.json,
the JSON lines of OUT/bench_floor.log, OUT/bench_torch.json (or bench_torch.log saying PyTorch is
not there), and the feature runs' metrics (bf16_*, zeropp_gpu_*, hpz_gpu_s3, twolevel_gpu_s3,
offload_*, muon_*, moe_*, and the model-parallel modes' {tp,sp,pp,ep}_gpu_s{1,3}, _cpu_s3); writes
OUT/summary.json and exits 1 when a check failed.
"""
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional
from xml.etree import ElementTree

LOSS_RTOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}   # GPU vs CPU losses, relative (BLAS sums in other orders)
COPY_FRACTION = 0.8                         # issue 4's GPU bar: fused AdamW >= 0.8 x device copy at 64M


def _load(path: Path) -> Optional[object]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def status(out: Path) -> Dict[str, tuple]:
    """name -> (exit status, seconds) of every step gpu_check.sh ran."""
    rows = {}
    try:
        for line in out.joinpath("status.txt").read_text().splitlines():
            name, rc, secs = line.split()
            rows[name] = (int(rc), int(secs))
    except OSError:
        pass
    return rows


def check_pytest(out: Path, st: Dict[str, tuple]) -> dict:
    rc = st.get("pytest_gpu", (None, 0))[0]
    detail = "no result"
    tests = failures = skipped = 0
    try:
        suite = ElementTree.parse(out / "pytest_gpu.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        tests = int(suite.get("tests", 0))
        failures = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        detail = f"{tests - failures - skipped} passed, {failures} failed, {skipped} skipped"
    except (OSError, ElementTree.ParseError, AttributeError):
        pass
    # Skips would mean the GPU tests did not run: on this machine they must all run.
    return {"check": "kernels and staged collectives vs NumPy oracles (pytest)",
            "ok": rc == 0 and tests > 0 and failures == 0 and skipped == 0, "detail": detail}


def _stages(out: Path, prefix: str, stages) -> Dict[int, Optional[dict]]:
    return {s: _load(out / f"{prefix}_s{s}.json") for s in stages}


def _on_gpu(runs) -> bool:
    return all("gpu" in str(m.get("device", "")) for m in runs)


def check_stage_set(out: Path, label: str, gpu: str, cpu: Optional[str], dtype: str, stages=range(4)) -> dict:
    """The GPU runs ``gpu``_s{stage} give one final parameter hash; with ``cpu``, each GPU run's
    losses follow the CPU run's of the same stage within LOSS_RTOL[dtype]."""
    runs = _stages(out, gpu, stages)
    ref = _stages(out, cpu, stages) if cpu else {}
    missing = ([f"{gpu}_s{s}" for s, m in runs.items() if m is None]
               + [f"{cpu}_s{s}" for s, m in ref.items() if m is None])
    if missing:
        return {"check": label, "ok": False, "detail": f"missing runs: {missing}"}
    gpu_hashes = {m["final_params_sha256"] for m in runs.values()}
    detail = f"GPU stages {'bit-identical' if len(gpu_hashes) == 1 else 'DIFFER'}"
    ok = len(gpu_hashes) == 1 and _on_gpu(runs.values())
    if cpu:
        cpu_hashes = {m["final_params_sha256"] for m in ref.values()}
        worst = max(abs(a - b) / max(abs(b), 1e-30) for s in stages
                    for a, b in zip(runs[s]["losses"], ref[s]["losses"]))
        ok = ok and len(cpu_hashes) == 1 and worst <= LOSS_RTOL[dtype]
        detail += (f"; CPU stages {'bit-identical' if len(cpu_hashes) == 1 else 'DIFFER'}; "
                   f"GPU vs CPU losses within {worst:.1e} (tolerance {LOSS_RTOL[dtype]:g})")
    else:
        first = next(iter(runs.values()))["losses"]
        ok = ok and first[-1] < first[0]
        detail += f"; loss {first[0]:.4g} -> {first[-1]:.4g}"
    return {"check": label, "ok": ok, "detail": detail + ("" if _on_gpu(runs.values()) else "; NOT on the GPU")}


def check_parity(out: Path) -> List[dict]:
    return [check_stage_set(out, f"stage 0-3 parity, N={n} {dtype}", f"parity_gpu_n{n}_{dtype}",
                            f"parity_cpu_n{n}_{dtype}" if n == 2 else None, dtype)
            for n in (2, 4) for dtype in ("fp32", "fp16")]


def check_same_bits(out: Path, label: str, names: List[str]) -> dict:
    """Every run of ``names`` ends with the same final parameters, on the GPU."""
    runs = {n: _load(out / f"{n}.json") for n in names}
    missing = [n for n, m in runs.items() if m is None]
    if missing:
        return {"check": label, "ok": False, "detail": f"missing runs: {missing}"}
    hashes = {n: m["final_params_sha256"][:12] for n, m in runs.items()}
    same = len(set(hashes.values())) == 1
    return {"check": label, "ok": same and _on_gpu(runs.values()),
            "detail": ("the same bits" if same else f"DIFFER: {hashes}")
                      + ("" if _on_gpu(runs.values()) else "; NOT on the GPU")}


def check_features(out: Path) -> List[dict]:
    rows = [check_stage_set(out, "bf16 stages 0-3, N=2", "bf16_gpu", "bf16_cpu", "bf16"),
            check_stage_set(out, "two levels + qwZ int8 + qgZ int4, N=4 in 2 nodes, stages 1-3", "zeropp_gpu", None,
                            "fp16", stages=range(1, 4)),
            check_same_bits(out, "hpZ = two-level stage 3 (N=4 in 2 nodes)", ["hpz_gpu_s3", "twolevel_gpu_s3"]),
            check_stage_set(out, "Muon stages 0-3, N=2 (GPT, fp32)", "muon_gpu", "muon_cpu", "fp32")]
    for stage in (2, 3):
        rows.append(check_same_bits(out, f"optimizer offload cpu, nvme = in memory, stage {stage}",
                                    [f"parity_gpu_n2_fp16_s{stage}", f"offload_cpu_gpu_s{stage}",
                                     f"offload_nvme_gpu_s{stage}"]))
    return rows


MODES = {"tp": "--tp 2", "sp": "--sp 2", "pp": "--pp 2", "ep": "--experts 4 --ep 2"}


def check_modes(out: Path) -> List[dict]:
    """Each model-parallel mode on the GPU at N=4 ({mode}_gpu_s1, _s3): stages 1 and 3 bit-identical, the losses
    within fp32's LOSS_RTOL of the CPU's ({mode}_cpu_s3)."""
    rows = []
    for mode, flags in MODES.items():
        label = f"{flags}, stages 1 and 3, N=4 (GPT, fp32)"
        row = check_same_bits(out, label, [f"{mode}_gpu_s1", f"{mode}_gpu_s3"])
        gpu, cpu = _load(out / f"{mode}_gpu_s3.json"), _load(out / f"{mode}_cpu_s3.json")
        if row["ok"] and cpu is None:
            row.update(ok=False, detail=f"missing runs: ['{mode}_cpu_s3']")
        elif row["ok"]:
            worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(gpu["losses"], cpu["losses"]))
            row["ok"] = worst <= LOSS_RTOL["fp32"] and len(gpu["losses"]) == len(cpu["losses"]) > 0
            row["detail"] += f"; GPU vs CPU losses within {worst:.1e} (tolerance {LOSS_RTOL['fp32']:g})"
        rows.append(row)
    return rows


def check_moe(out: Path) -> dict:
    """The MoE GPT at stage 3 on the GPU (moe_gpu_s3) beside the CPU (moe_cpu_s3): losses within fp32's
    LOSS_RTOL; whether the routing (tokens per expert, drops) came out the same is shown."""
    label = "MoE --experts 4 stage 3, N=2 (GPT, fp32)"
    gpu, cpu = _load(out / "moe_gpu_s3.json"), _load(out / "moe_cpu_s3.json")
    if gpu is None or cpu is None:
        return {"check": label, "ok": False, "detail": "missing runs: "
                + str([n for n, m in (("moe_gpu_s3", gpu), ("moe_cpu_s3", cpu)) if m is None])}
    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(gpu["losses"], cpu["losses"]))
    keys = ("tokens_min", "tokens_max", "dropped")
    same = all((gpu.get("moe") or {}).get(k) == (cpu.get("moe") or {}).get(k) for k in keys)
    ok = worst <= LOSS_RTOL["fp32"] and len(gpu["losses"]) == len(cpu["losses"]) > 0 and _on_gpu([gpu])
    return {"check": label, "ok": ok,
            "detail": f"GPU vs CPU losses within {worst:.1e} (tolerance {LOSS_RTOL['fp32']:g}); routing "
                      f"{'the same' if same else 'DIFFERS'}" + ("" if _on_gpu([gpu]) else "; NOT on the GPU")}


def json_lines(path: Path) -> List[dict]:
    """The JSON objects printed one per line in a log (other lines skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def check_floor(out: Path) -> dict:
    recs = [r for r in json_lines(out / "bench_floor.log") if "model" in r]
    label = "GPT step per stage against its GEMM floor on the GPU"
    if not recs:
        return {"check": label, "ok": False, "detail": "no records"}
    parts = []
    for r in recs:
        ratios = "/".join(f"{v['over_floor']:.1f}" for _, v in sorted(r["stages"].items()))
        parts.append(f"{r['model']} N={r['N']}: floor {r['floor_s'] * 1e3:.2f} ms, stages 0-3 {ratios}x")
    ok = all(r["stages_bit_identical"] and "gpu" in r["device"] for r in recs)
    return {"check": label + " (stages bit-identical)", "ok": ok, "detail": "; ".join(parts)}


def check_torch(out: Path) -> dict:
    label = "the GPT under PyTorch beside zerompi (parity, then step times)"
    recs = _load(out / "bench_torch.json")
    if recs is None:
        log = (out / "bench_torch.log").read_text() if (out / "bench_torch.log").exists() else ""
        absent = "not installed" in log
        return {"check": label, "ok": absent, "detail": "PyTorch with CUDA is not installed here" if absent else
                "no records"}
    parts = []
    for r in recs:
        st = r.get("step_s", {})
        parts.append(f"{r['model']}: torch fp32 {st.get('torch_fp32', float('nan')) * 1e3:.2f} / bf16 "
                     f"{st.get('torch_bf16', float('nan')) * 1e3:.2f} ms, zerompi/torch fp32 "
                     f"{r.get('zerompi_over_torch_fp32', float('nan')):.2f}x, bf16 "
                     f"{r.get('zerompi_over_torch_bf16', float('nan')):.2f}x"
                     + (f" (skipped: {r['skipped']})" if r.get("skipped") else ""))
    return {"check": label, "ok": all(r["parity"]["ok"] for r in recs), "detail": "; ".join(parts)}


def check_bench_adam(out: Path) -> dict:
    data = _load(out / "bench_adam.json")
    recs = [r for r in (data or {}).get("records", []) if r.get("backend") == "gpu"]
    if not recs:
        return {"check": "bench_adam on the GPU", "ok": False, "detail": "no gpu records"}
    big = max(recs, key=lambda r: r["n"])
    ratio = big["fused_gbps"] / big["copy_gbps"]
    return {"check": f"bench_adam: fused >= {COPY_FRACTION} x device copy at {big['n'] >> 20}M",
            "ok": ratio >= COPY_FRACTION,
            "detail": f"fused {big['fused_gbps']:.0f} GB/s, copy {big['copy_gbps']:.0f} GB/s ({ratio:.2f}x), "
                      f"NumPy-on-CuPy {big['numpy_gbps']:.0f} GB/s"}


def check_bench_comm(out: Path, name: str = "bench_comm", label: str = "staged") -> dict:
    recs = _load(out / f"{name}.json") or []
    if not recs:
        return {"check": f"zerompi.bench --device gpu ({label})", "ok": False, "detail": "no records"}
    wrong = sum(r["wrong"] or 0 for r in recs)
    rs = {(r["impl"], r["bytes"]): r["busbw"] for r in recs if r["op"] == "reduce_scatter"}
    sizes = sorted(b for impl, b in rs if impl == "zerompi")
    detail = ", ".join(f"{b >> 20} MiB {rs[('zerompi', b)]:.2f}/{rs.get(('mpi', b), float('nan')):.2f}" for b in sizes)
    return {"check": f"zerompi.bench --device gpu ({label}), --check", "ok": wrong == 0,
            "detail": f"{wrong} wrong in {len(recs)} rows; RS busbw GB/s {label}/host-MPI: {detail}"}


def check_gpt(out: Path, name: str = "gpt", label: str = "GPT on the GPU (60 steps, N=2)") -> dict:
    m = _load(out / f"{name}.json")
    if not m:
        return {"check": label, "ok": False, "detail": "no metrics"}
    losses = m["losses"]
    val = m["val_losses"][-1][1] if m.get("val_losses") else float("nan")
    ok = losses[-1] < 0.8 * losses[0] and "gpu" in str(m.get("device", ""))
    return {"check": label, "ok": ok,
            "detail": f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, held-out {val:.3f}, "
                      f"{m.get('tokens_per_s') or 0:,.0f} tok/s, pool {m.get('cupy_pool_bytes')}"}


def summarize(out: Path) -> dict:
    st = status(out)
    checks = [check_pytest(out, st)] + check_parity(out) + [
        check_bench_adam(out), check_bench_comm(out), check_bench_comm(out, "bench_nccl", "nccl"),
        check_gpt(out), check_gpt(out, "gpt_nccl", "GPT over NCCL (30 steps)"),
        check_floor(out), check_torch(out)] + check_features(out) + [check_moe(out)] + check_modes(out)
    failed_steps = sorted(name for name, (rc, _) in st.items() if rc != 0)
    not_run = sorted(name for name, (rc, _) in st.items() if rc == -1)
    return {"env": _load(out / "env.json"), "checks": checks, "failed_steps": failed_steps, "not_run": not_run,
            "seconds": sum(secs for _, secs in st.values()),
            "ok": all(c["ok"] for c in checks) and not failed_steps}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python scripts/gpu_summary.py OUT\n")
        return 2
    out = Path(argv[0])
    s = summarize(out)
    out.joinpath("summary.json").write_text(json.dumps(s, indent=1))
    env = s["env"] or {}
    print(f"\nGPU check: {env.get('gpu', '?')} x{env.get('gpus', '?')}, CuPy {env.get('cupy', '?')}, "
          f"{env.get('mpi', '?')}, CUDA-aware MPI: {env.get('cuda_aware', '?')}; steps took {s['seconds']} s")
    width = max(len(c["check"]) for c in s["checks"])
    for c in s["checks"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'}  {c['check']:<{width}}  {c['detail']}")
    if s["failed_steps"]:
        print(f"  failed steps: {', '.join(s['failed_steps'])} (logs in {out})")
    if s["not_run"]:
        print(f"  not run (the time budget was spent): {', '.join(s['not_run'])}")
    print("ALL PASSED" if s["ok"] else "SOME CHECKS FAILED")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
