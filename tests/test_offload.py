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
        if c["offload_optimizer"] == "nvme":          # the updates began in the backward (engine/in_backward.py)
            assert r["in_backward"]["kept"] > 0, r


def test_updates_in_the_backward_equal_the_plain_run_bit_for_bit(tmp_path):
    """nvme: a bucket's update starts in the backward when its shard is final, with a guess of the step's
    scalars (engine/in_backward.py). Kept when the guess holds, taken back when the step clips, changes
    the learning rate or is skipped: the bits equal the plain run's in every case, and each case really
    took the path it is there for (stage 1's accumulator, qwZ, host transfers, a schedule, clipping)."""
    nvme = dict(bucket_mb=0.002, offload_optimizer="nvme")
    configs = [
        dict(nvme, stage=2, dtype="fp16", staged=True),
        dict(nvme, stage=1, dtype="fp32", micro_batches=2),
        dict(nvme, stage=2, dtype="fp16", quantize_weights="int8"),
        dict(nvme, stage=2, dtype="fp32", lr_schedule=True),
        dict(nvme, stage=3, dtype="fp32", clip=0.39),
        dict(nvme, stage=2, dtype="fp16", offload_io="buffered"),         # the page cache, not O_DIRECT
    ]
    for r in cases(tmp_path, 2, configs):
        assert r["ranks_differing"] == 0, r["case"]
        early, c = r["in_backward"], r["case"]
        assert early["kept"] > 0, r
        if c.get("clip") or r["lr_schedule"]:           # clipped steps; a new learning rate
            assert early["taken_back"] > 0 and early["kept"] < 6, r
    # A step skipped for a NaN gradient (rank 1's, at step 3): the early updates are taken back.
    skip = [dict(nvme, stage=2, dtype="fp16"), dict(nvme, stage=3, dtype="fp16", offload_params="nvme"),
            dict(nvme, stage=2, dtype="fp16", quantize_weights="int8")]
    d = tmp_path / "skip"
    d.mkdir()
    proc = run_mpi(2, [DRIVER, d, json.dumps(skip)], timeout=240, env={"ZEROMPI_FAULT": "nan@rank1:step3"})
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(skip), proc.stdout + proc.stderr
    for r in out:
        assert r["ranks_differing"] == 0 and r["in_backward"] == {"kept": 5, "taken_back": 1}, r


def test_without_room_for_a_spare_generation_the_update_waits_for_the_norm(tmp_path, monkeypatch):
    """An offload folder with room for one generation of the rows: they are rewritten in place, nothing
    is updated in the backward, and the bits are the plain run's."""
    import numpy as np
    from zerompi.engine.offload.stream import file_bytes
    layers = [(f"l{i}", {f"w{i}": np.linspace(-1, 1, 500 + i, dtype=np.float32)}) for i in range(3)]

    def train(**kw):
        eng = ZeroEngine(layers, ZeroConfig(stage=2, dtype="fp32", bucket_mb=0.001, **kw))
        for _ in range(3):
            for i in range(3):
                with eng.unsharded(i) as p:
                    g = np.cos(p[f"w{i}"] * 3)
                eng.grads_ready(i, {f"w{i}": g})
            eng.step()
        out, spare, early = eng.full_parameters(), getattr(eng.optimizer.rows, "spare", None), eng.in_backward.possible
        one = file_bytes([b.shard_slice for b in eng.layout.buckets], 1)
        eng.close()
        return out, spare, early, one
    want, _, _, one = train()
    room = 4096 + one + one // 2           # one generation and a half
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 0, room))
    got, spare, early, _ = train(offload_optimizer="nvme", offload_dir=str(tmp_path))
    assert spare is False and early is False
    assert all(np.array_equal(want[k].view(np.uint32), got[k].view(np.uint32)) for k in want)


def test_memory_by_place_equals_the_formula(tmp_path):
    out = tmp_path / "m.json"                  # outside the offload folder (tests/test_path_roles.py)
    (tmp_path / "off").mkdir()
    run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--width", "32", "--depth", "8", "--batch", "8",
                "--steps", "2", "--stage", "3", "--bucket-mb", "0.002", "--offload-optimizer", "nvme",
                "--offload-params", "nvme", "--offload-dir", tmp_path / "off", "--metrics-json", out], timeout=120)
    m = json.loads(out.read_text())
    got, want = m["memory_bytes_by_place"], m["theory_bytes_by_place"]
    states = {k: v for k, v in got["disk"].items() if k in ("params", "optimizer")}
    assert states == {k: v for k, v in want["disk"].items() if k != "total"}
    assert want["disk"]["optimizer"] == 12 * m["padded_params"] // 2
    assert got["disk"]["buffers"] == want["disk"]["optimizer"]          # the rows' spare generation
    assert got["device"]["grads"] == want["device"]["grads"] and "params" not in got["device"]
    # Streaming: four buckets' rows on the host (8 buckets here), not the whole state (each buffer padded
    # to a multiple of 4 KiB and cut at a 4 KiB boundary, for O_DIRECT).
    rows = 4 * 12 * m["padded_params"] // 2 // 8
    assert rows <= got["host"]["buffers"] <= rows + 4 * 3 * 2 * 4096, got["host"]


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


@pytest.mark.parametrize("stage,warmup", [(1, 0), (2, 5), (3, 0)])
def test_delayed_update_matches_its_float64_reference(stage, warmup):
    """Step k's gradient is taken at the parameters before update k - 1: the engine follows the
    float64 reference of that algorithm, and visibly not the plain one's. With a warm-up of 5 steps
    (offload_delayed_warmup), the first 5 updates are not delayed: its own reference, neither of the others."""
    proc = run_mpi(2, [ROOT / "tests" / "drivers" / "delayed.py", stage, warmup], timeout=120)
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["delayed"]["vs_own_reference"] < 1e-6 and r["delayed"]["vs_other_reference"] > 1e-2, r
    assert r["plain"]["vs_own_reference"] < 1e-6, r
    if warmup:
        w = r["warmup"]
        assert w["vs_own_reference"] < 1e-6 and w["vs_plain_reference"] > 1e-3 and w["vs_delayed_reference"] > 1e-3, r


@pytest.mark.parametrize("kw,match", [
    (dict(stage=2, offload_delayed_update=True), "needs offload_optimizer='cpu'"),
    (dict(stage=2, offload_optimizer="cpu", offload_delayed_warmup=5), "applies with the delayed update only"),
    (dict(stage=2, offload_optimizer="cpu", offload_delayed_update=True, offload_delayed_warmup=-1),
     "must be a whole number of steps >= 0"),
    (dict(stage=2, offload_optimizer="nvme"), "offload to nvme needs offload_dir"),
    (dict(stage=0, offload_optimizer="cpu"), "needs stage 1, 2 or 3"),
    (dict(stage=2, offload_params="nvme", offload_dir="x"), "needs stage 3"),
    (dict(stage=2, offload_optimizer="disk"), "offload_optimizer='disk' is not allowed; use none, cpu or nvme"),
    (dict(stage=2, offload_optimizer="nvme", offload_dir="x", offload_io="aio"), "offload_io='aio' is not allowed"),
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
    with pytest.raises(ConfigError, match="has 100 bytes free; this rank's offload files need 16,384"):
        ZeroEngine(layers, ZeroConfig(stage=2, offload_optimizer="nvme", offload_dir=str(tmp_path)))


def test_cli_refuses_offload_without_a_folder(tmp_path):
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--offload-optimizer", "nvme"], timeout=60,
                   check=False)
    one_line(proc, 2, "needs offload_dir")


@pytest.mark.parametrize("stage,opt,par", [(1, "cpu", "none"), (2, "nvme", "none"), (3, "nvme", "nvme"),
                                           (3, "none", "none")])
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
