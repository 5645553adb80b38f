"""ZeRO-Offload / ZeRO-Infinity (engine/offload/): the optimizer state in host memory or files,
stage 3's parameter shard in a file. The oracle is the same run without offload: the final
parameters must be equal bit for bit (cpu and nvme, stages 1-3, fp16 and fp32, micro-batches,
clip, N = 1..3), and through the staged Communicator's host transfers, whose "device" arrays
make every copy down and up happen."""
import hashlib
import json
import shutil

import pytest

from tests.mpirun import ROOT, one_line, run_mpi
from zerompi import ConfigError, ZeroConfig, ZeroEngine

DRIVER = ROOT / "tests" / "drivers" / "offload.py"


def cases(tmp_path, n, configs):
    d = tmp_path / "offload"
    d.mkdir(exist_ok=True)
    proc = run_mpi(n, [DRIVER, d, json.dumps(configs)], timeout=240)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(configs), proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_offloaded_runs_equal_the_plain_run_bit_for_bit(tmp_path, n):
    configs = [
        dict(stage=1, dtype="fp32", bucket_mb=0.002, offload_optimizer="cpu", clip=0.5),
        dict(stage=2, dtype="fp16", bucket_mb=0.002, offload_optimizer="cpu", staged=True, micro_batches=2),
        dict(stage=3, dtype="fp32", bucket_mb=0.002, offload_optimizer="nvme", micro_batches=2, clip=0.5),
        dict(stage=3, dtype="fp16", bucket_mb=0.002, offload_optimizer="nvme", offload_params="nvme"),
        dict(stage=3, dtype="fp16", bucket_mb=0.002, offload_optimizer="cpu", offload_params="nvme", staged=True),
        dict(stage=1, dtype="fp16", bucket_mb=25, offload_optimizer="nvme"),          # one bucket: one buffer set
    ]
    for r in cases(tmp_path, n, configs):
        assert r["ranks_differing"] == 0, r["case"]
        assert r["files_left"] == [], r          # the scratch files go with close()
        c = r["case"]
        opt = {"cpu": "host", "nvme": "disk"}[c["offload_optimizer"]]
        assert r["places"][opt]["optimizer"] > 0 and "optimizer" not in r["places"]["device"]
        if c.get("offload_params") == "nvme":
            assert r["places"]["disk"]["params"] > 0 and "params" not in r["places"]["device"]


def test_memory_by_place_equals_the_formula(tmp_path):
    out = tmp_path / "m.json"
    run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--width", "32", "--depth", "8", "--batch", "8",
                "--steps", "2", "--stage", "3", "--bucket-mb", "0.002", "--offload-optimizer", "nvme",
                "--offload-params", "nvme", "--offload-dir", tmp_path, "--metrics-json", out], timeout=120)
    m = json.loads(out.read_text())
    got, want = m["memory_bytes_by_place"], m["theory_bytes_by_place"]
    assert got["disk"] == want["disk"] and want["disk"]["optimizer"] == 12 * m["padded_params"] // 2
    assert got["device"]["grads"] == want["device"]["grads"] and "params" not in got["device"]
    # Streaming: three buckets' rows on the host (8 buckets here), not the whole state.
    assert got["host"]["buffers"] == 3 * 12 * m["padded_params"] // 2 // 8


def test_a_checkpoint_of_an_offloaded_run_is_the_same_checkpoint(tmp_path):
    def shards(tag, *flags):
        run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--width", "24", "--depth", "3", "--batch", "8",
                    "--steps", "3", "--stage", "2", "--bucket-mb", "0.002", "--save-dir", tmp_path / tag, *flags],
                timeout=120)
        step = tmp_path / tag / "step_000003"
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step.glob("shard_*.npy"))}
    (tmp_path / "o").mkdir()
    plain = shards("plain")
    assert plain == shards("nvme", "--offload-optimizer", "nvme", "--offload-dir", tmp_path / "o")
    assert plain == shards("cpu", "--offload-optimizer", "cpu")
    # and it resumes in another mode, world size and stage
    proc = run_mpi(3, ["-m", "zerompi.train", "--model", "mlp", "--width", "24", "--depth", "3", "--batch", "12",
                       "--steps", "5", "--stage", "3", "--bucket-mb", "0.002", "--offload-optimizer", "nvme",
                       "--offload-params", "nvme", "--offload-dir", tmp_path / "o", "--resume", tmp_path / "plain"],
                   timeout=120)
    assert "resumed from" in proc.stdout and "step     5/5" in proc.stdout


def test_a_lost_offload_file_stops_every_rank_with_one_line(tmp_path):
    proc = run_mpi(2, [ROOT / "tests" / "drivers" / "offload_fail.py", tmp_path], timeout=90, check=False)
    assert proc.returncode != 0 and "finished" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("zerompi")]
    assert len(lines) == 1, proc.stderr
    assert "zerompi-optimizer-rank1" in lines[0] and "failed at step 3" in lines[0] and "truncated" in lines[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_delayed_update_matches_its_float64_reference(stage):
    """Step k's gradient is taken at the parameters before update k - 1: the engine follows the
    float64 reference of that algorithm, and visibly not the plain one's."""
    proc = run_mpi(2, [ROOT / "tests" / "drivers" / "delayed.py", stage], timeout=120)
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["delayed"]["vs_own_reference"] < 1e-6 and r["delayed"]["vs_other_reference"] > 1e-2, r
    assert r["plain"]["vs_own_reference"] < 1e-6, r


@pytest.mark.parametrize("kw,match", [
    (dict(stage=2, offload_delayed_update=True), "needs offload_optimizer='cpu'"),
    (dict(stage=2, offload_optimizer="nvme"), "offload to nvme needs offload_dir"),
    (dict(stage=0, offload_optimizer="cpu"), "needs stage 1, 2 or 3"),
    (dict(stage=2, offload_params="nvme", offload_dir="x"), "needs stage 3"),
    (dict(stage=2, offload_optimizer="disk"), "offload_optimizer='disk' is not allowed; use none, cpu or nvme"),
])
def test_bad_offload_settings_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        ZeroConfig(**kw)


def test_offload_dir_is_checked_at_start(tmp_path, monkeypatch):
    import numpy as np
    layers = [("l", {"w": np.zeros(64, np.float32)})]
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        ZeroEngine(layers, ZeroConfig(stage=2, offload_optimizer="nvme", offload_dir=str(not_a_dir)))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 100))
    with pytest.raises(ConfigError, match="has 100 bytes free; this rank's offload files need 4,864"):
        ZeroEngine(layers, ZeroConfig(stage=2, offload_optimizer="nvme", offload_dir=str(tmp_path)))


def test_cli_refuses_offload_without_a_folder(tmp_path):
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--offload-optimizer", "nvme"], timeout=60,
                   check=False)
    one_line(proc, 2, "needs offload_dir")


@pytest.mark.parametrize("stage,opt,par", [(1, "cpu", "none"), (2, "nvme", "none"), (3, "nvme", "nvme"), (3, "none", "none")])
def test_the_estimate_splits_model_states_by_place_as_the_engine_holds_them(tmp_path, stage, opt, par):
    import numpy as np
    import zerompi
    layers = [(f"l{i}", {f"w{i}": np.zeros(300 + 7 * i, np.float32)}) for i in range(5)]
    cfg = ZeroConfig(stage=stage, dtype="fp16", bucket_mb=0.001, offload_optimizer=opt, offload_params=par,
                     offload_dir=str(tmp_path) if "nvme" in (opt, par) else None)
    eng = ZeroEngine(layers, cfg)
    row = zerompi.estimate(layout=eng.layout, dtype="fp16", offload_optimizer=opt,
                           offload_params=par)["stages"][stage]["model_state_bytes_by_place"]
    held = eng.ledger.by_place()
    for place in ("device", "host", "disk"):
        states = {k: v for k, v in held[place].items() if k in ("params", "grads", "optimizer")}
        assert states == {k: v for k, v in row[place].items() if k != "total"}, (place, held, row)
    eng.close()


def test_the_final_hash_waits_for_the_delayed_update(monkeypatch):
    """The train CLI's final_params_sha256 reads the master a bucket at a time (gather_buckets): with the
    delayed update still running behind the last step, it must read the master after that update, as
    full_parameters() does (before: whatever the background thread had written so far, so that two
    resumes from one checkpoint hashed differently under load). The update is slowed to make the race sure."""
    import time
    import numpy as np
    from zerompi.optim import impl
    cfg = ZeroConfig(stage=1, dtype="fp32", lr=0.1, offload_optimizer="cpu", offload_delayed_update=True)
    eng = ZeroEngine([("lin", {"x": np.zeros(64, np.float32)})], cfg)
    update = impl.host_adamw_update

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return update(*args, **kwargs)
    monkeypatch.setattr(impl, "host_adamw_update", slow)
    for _ in range(2):
        with eng.unsharded(0):
            pass
        eng.grads_ready(0, {"x": np.ones(64, np.float32)})
        eng.step()
    read = np.concatenate([values for _, values in eng.optimizer.gather_buckets(eng.group, eng.steps_taken)])
    want = eng.full_parameters()["x"]
    eng.close()
    assert np.array_equal(read[:64], want) and not np.array_equal(want, np.zeros(64, np.float32))
