"""The table scripts/gpu_check.sh prints last: every GPU check, passed or not, from its files.

    python scripts/gpu_summary.py OUT        # OUT: gpu_check.sh's result folder

Reads OUT/status.txt (one "name exit seconds" line per step), OUT/env.json, the parity runs'
metrics (OUT/parity_{gpu,cpu}_n{N}_{dtype}_s{stage}.json), OUT/bench_adam.json,
OUT/bench_comm.json, OUT/bench_nccl.json, OUT/gpt.json and OUT/gpt_nccl.json; writes OUT/summary.json and exits 1 when a check failed.
"""
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional
from xml.etree import ElementTree

LOSS_RTOL = {"fp32": 1e-4, "fp16": 2e-2}   # GPU vs CPU losses, relative (BLAS sums in other orders)
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


def check_parity(out: Path) -> List[dict]:
    rows = []
    for n in (2, 4):
        for dtype in ("fp32", "fp16"):
            runs = {(dev, s): _load(out / f"parity_{dev}_n{n}_{dtype}_s{s}.json") for dev in ("gpu", "cpu")
                    for s in range(4)}
            missing = [k for k, v in runs.items() if v is None]
            if missing:
                rows.append({"check": f"stage 0-3 parity, N={n} {dtype}", "ok": False,
                             "detail": f"missing runs: {missing}"})
                continue
            gpu_hashes = {runs[("gpu", s)]["final_params_sha256"] for s in range(4)}
            cpu_hashes = {runs[("cpu", s)]["final_params_sha256"] for s in range(4)}
            worst = 0.0
            for s in range(4):
                for a, b in zip(runs[("gpu", s)]["losses"], runs[("cpu", s)]["losses"]):
                    worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
            on_gpu = all("gpu" in str(runs[("gpu", s)].get("device", "")) for s in range(4))
            ok = len(gpu_hashes) == 1 and len(cpu_hashes) == 1 and worst <= LOSS_RTOL[dtype] and on_gpu
            rows.append({"check": f"stage 0-3 parity, N={n} {dtype}", "ok": ok,
                         "detail": f"GPU stages {'bit-identical' if len(gpu_hashes) == 1 else 'DIFFER'}; "
                                   f"CPU stages {'bit-identical' if len(cpu_hashes) == 1 else 'DIFFER'}; "
                                   f"GPU vs CPU losses within {worst:.1e} (tolerance {LOSS_RTOL[dtype]:g})"
                                   + ("" if on_gpu else "; NOT on the GPU")})
    return rows


def check_bench_adam(out: Path) -> dict:
    data = _load(out / "bench_adam.json")
    recs = [r for r in (data or {}).get("records", []) if r.get("backend") == "gpu"]
    if not recs:
        return {"check": "bench_adam on the GPU", "ok": False, "detail": "no gpu records"}
    big = max(recs, key=lambda r: r["n"])
    ratio = big["fused_gbps"] / big["copy_gbps"]
    return {"check": f"bench_adam: fused >= {COPY_FRACTION} x device copy at {big['n'] >> 20}M", "ok": ratio >= COPY_FRACTION,
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
        check_gpt(out), check_gpt(out, "gpt_nccl", "GPT over NCCL (30 steps)")]
    failed_steps = sorted(name for name, (rc, _) in st.items() if rc != 0)
    return {"env": _load(out / "env.json"), "checks": checks, "failed_steps": failed_steps,
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
    print("ALL PASSED" if s["ok"] else "SOME CHECKS FAILED")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
