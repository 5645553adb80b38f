"""checkpoint/orphans.py: a complete temporary folder that no one published is published; an incomplete one is
left; a folder another caller has claimed (renamed to publish it) is left alone by a salvaging rank and taken
by the callers that hold the save folder's lock (the next run), so that a claimer that died midway loses nothing.

Oracle: the files (what ``latest`` names, what the published folder holds, what is left)."""
import json
import os

from zerompi.checkpoint.format import shard_file
from zerompi.checkpoint.orphans import CLAIM, recover
from zerompi.checkpoint.pointer import DRAFT, ENTRY, latest_name


def unpublished(directory, step, world=2, suffix=""):
    """A temporary folder as a save leaves it once every shard is written: the draft, each shard and its entry."""
    tmp = directory / f".tmp-step_{step:06d}-0123abcd{suffix}"
    tmp.mkdir(parents=True)
    (tmp / DRAFT).write_text(json.dumps({"world_size": world, "step": step}))
    for r in range(world):
        data = bytes([r + 1]) * (64 + r)
        (tmp / shard_file(r)).write_bytes(data)
        (tmp / (shard_file(r) + ENTRY)).write_text(json.dumps({"file": shard_file(r), "bytes": len(data),
                                                               "crc32": 0}))
    return tmp


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_complete_folder_is_published_and_an_incomplete_one_left(tmp_path):
    unpublished(tmp_path, 2)
    half = unpublished(tmp_path, 4)
    (half / (shard_file(1) + ENTRY)).unlink()                # rank 1's write never ended
    lines = recover(str(tmp_path))
    assert len(lines) == 1 and "complete checkpoint of step 2" in lines[0], lines
    assert latest_name(str(tmp_path)) == "step_000002"
    assert names(tmp_path) == [half.name, "latest", "step_000002"]
    assert names(tmp_path / "step_000002") == ["manifest.json", shard_file(0), shard_file(1)]
    manifest = json.loads((tmp_path / "step_000002" / "manifest.json").read_text())
    assert [s["bytes"] for s in manifest["shards"]] == [64, 65]


def test_a_claimed_folder_is_left_by_a_salvage_and_taken_by_the_next_run(tmp_path):
    """A salvaging rank (claimed=False) finds a folder another rank renamed to publish it and leaves it: taking it
    midway made that rank's publication fail, and the job's end could then leave it to neither. A claimer that
    died midway leaves the folder claimed: the next run (claimed=True) publishes it."""
    claimed = unpublished(tmp_path, 2, suffix=f"{CLAIM}4242")
    assert recover(str(tmp_path), claimed=False) == []
    assert names(tmp_path) == [claimed.name] and (claimed / DRAFT).exists()
    lines = recover(str(tmp_path))
    assert len(lines) == 1 and latest_name(str(tmp_path)) == "step_000002", lines
    assert names(tmp_path) == ["latest", "step_000002"]


def test_rank_0_claims_its_save_before_publishing_it(tmp_path, monkeypatch):
    """Rank 0's own publication (writer.PendingSave.publish) claims the folder first: a salvaging rank of the same job
    that looks in meanwhile (an abort while the save is being published) leaves it, and rank 0's publication ends.
    Unclaimed, the salvage took the folder from under it and rank 0's publication failed."""
    from types import SimpleNamespace

    from zerompi.checkpoint import writer
    tmp = unpublished(tmp_path, 6)
    draft = json.loads((tmp / DRAFT).read_text())
    seen = []
    real = writer.publish_files

    def publish_with_a_salvage_meanwhile(directory, folder, *args, **kwargs):
        seen.append((recover(directory, claimed=False), names(tmp_path)))
        return real(directory, folder, *args, **kwargs)

    monkeypatch.setattr(writer, "publish_files", publish_with_a_salvage_meanwhile)
    engine = SimpleNamespace(rank=0, layout=SimpleNamespace(world_size=2))
    pending = writer.PendingSave(engine, str(tmp_path), str(tmp), 6, draft, None, finish=None)
    entries = [json.loads((tmp / (shard_file(r) + ENTRY)).read_text()) for r in range(2)]
    path = pending.publish([("done", r, entries[r]) for r in range(2)])
    assert seen == [([], [f"{tmp.name}{CLAIM}{os.getpid()}"])], seen
    assert path == str(tmp_path / "step_000006") and latest_name(str(tmp_path)) == "step_000006"
    assert names(tmp_path) == ["latest", "step_000006"]
    manifest = json.loads((tmp_path / "step_000006" / "manifest.json").read_text())
    assert [s["bytes"] for s in manifest["shards"]] == [64, 65]


def test_a_publication_that_ended_before_its_rename_is_published_by_the_next_run(tmp_path, monkeypatch):
    """format.publish writes the manifest before it removes the draft and the entries; a publication that ends
    between the manifest and the rename leaves a folder its manifest describes whole, and the next run publishes
    it (the checkpoint as that manifest says, nothing lost). Before, such a folder was left for the next save to
    delete."""
    from zerompi.checkpoint import format
    from tests.test_replicas import tiny_engine

    class Crash(Exception):
        pass

    def crash(point, step, rank=None):
        if point == "before_rename":
            raise Crash

    tmp = unpublished(tmp_path, 5)
    entries = [json.loads((tmp / (shard_file(r) + ENTRY)).read_text()) for r in range(2)]
    manifest = format.build_manifest(tiny_engine(), entries, {"data_step": 5})
    monkeypatch.setattr(format, "crash_point", crash)
    try:
        format.publish(str(tmp_path), str(tmp), 5, manifest)
    except Crash:
        pass
    monkeypatch.undo()
    assert names(tmp) == ["manifest.json", shard_file(0), shard_file(1)]
    lines = recover(str(tmp_path))
    assert len(lines) == 1 and "complete checkpoint of step 5" in lines[0], lines
    assert latest_name(str(tmp_path)) == "step_000005" and names(tmp_path) == ["latest", "step_000005"]
    published, _ = format.read_manifest(str(tmp_path / "step_000005"))
    assert published["shards"] == entries and published["step"] == 5
    (tmp_path / "step_000005" / shard_file(1)).write_bytes(b"short")   # a shard of another size: not complete
    (tmp_path / "step_000005").rename(tmp_path / ".tmp-step_000005-0123abcd")
    assert recover(str(tmp_path)) == []


def test_a_salvage_waits_for_the_publication_another_rank_claimed(tmp_path, monkeypatch):
    """A salvaging rank (its job is ending) that finds the save claimed by another rank (rank 0 publishing it) waits
    for that publication, up to SALVAGE_WAIT_S, before its abort ends the job: it returned at once, and the abort
    could cut rank 0's publication short, leaving the checkpoint for the next run."""
    import threading
    import time
    from types import SimpleNamespace

    from zerompi.checkpoint import writer
    tmp = unpublished(tmp_path, 8)
    held = tmp.rename(tmp_path / f"{tmp.name}{CLAIM}4242")      # rank 0 has claimed it and is publishing
    pending = writer.PendingSave(SimpleNamespace(rank=1, layout=SimpleNamespace(world_size=2)), str(tmp_path),
                                 str(tmp), 8, None, None, finish=None)
    done = threading.Timer(0.4, lambda: recover(str(tmp_path)))   # its publication ends 0.4 s later
    done.start()
    t0 = time.monotonic()
    assert pending.recovered() == []                                # left to rank 0 ...
    waited = time.monotonic() - t0
    done.join()
    assert 0.35 < waited < writer.SALVAGE_WAIT_S, waited          # ... and waited for
    assert names(tmp_path) == ["latest", "step_000008"] and not held.exists()
    monkeypatch.setattr(writer, "SALVAGE_WAIT_S", 0.2)            # a claimer that never finishes: the wait ends
    tmp = unpublished(tmp_path, 10)
    tmp.rename(tmp_path / f"{tmp.name}{CLAIM}4243")
    pending = writer.PendingSave(SimpleNamespace(rank=1, layout=SimpleNamespace(world_size=2)), str(tmp_path),
                                 str(tmp), 10, None, None, finish=None)
    t0 = time.monotonic()
    assert pending.recovered() == [] and 0.2 <= time.monotonic() - t0 < 1.0
