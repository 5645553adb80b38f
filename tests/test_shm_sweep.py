"""tests/shm.py: a segment that appeared during the session and that nobody holds is removed; one that a
process holds open, one that was there before, and a file of another name are kept."""
import subprocess
import sys

from tests import shm


def test_sweep_removes_only_new_unheld_segments(tmp_path):
    folder = tmp_path / "shm"
    folder.mkdir()
    (folder / "mpich_shm_old_0").write_bytes(b"x")
    before = shm.present(folder)
    for name in ("mpich_shm_dead_0", "sm_segment.host.0.1", "mpich_shm_live_0", "user_file"):
        (folder / name).write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                               "time.sleep(60)", str(folder / "mpich_shm_live_0")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"          # the holder has the file open
        assert str(folder / "mpich_shm_live_0") in shm.held(folder)
        assert shm.sweep(before, folder) == ["mpich_shm_dead_0", "sm_segment.host.0.1"]
        assert sorted(p.name for p in folder.iterdir()) == ["mpich_shm_live_0", "mpich_shm_old_0", "user_file"]
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert shm.sweep(before, folder) == ["mpich_shm_live_0"]      # let go: swept by the next sweep
