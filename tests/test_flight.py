"""The flight recorder (comm/flight.py): each rank's last waits, its reporter answering over TCP,
and the fired watchdog's clause naming who had not arrived; the summary printed by one rank.
Across emulated nodes, with a link cut: tests/test_cluster_faults.py."""
import time

from zerompi.comm.flight import GONE, Peers, Reporter, ask_one, explain, hosts_line
from zerompi.comm.watchdog import HISTORY, WaitRecord, Watchdog
from zerompi.errors import EXIT_TIMEOUT

TABLE = [{"host": "node0"}, {"host": "node0"}, {"host": "node1"}, {"host": "node1"}]


def rep(rank, host, waiting=None, last=(), fired=False):
    return {"rank": rank, "host": host, "waiting": waiting, "last": list(last), "fired": fired}


def test_the_record_keeps_the_last_waits_once_each():
    record = WaitRecord()
    for step in range(HISTORY + 3):
        with record("all_gather", (0, step)):
            pass
        with record("all_gather", (0, step)):   # the test loop, then the wait of the same collective
            pass
    assert list(record.history) == [("all_gather", (0, s)) for s in range(3, HISTORY + 3)]


def test_a_node_that_does_not_answer_is_named_with_its_ranks():
    mine = "reduce_scatter of bucket 2 at step 7"
    reports = [rep(0, "node0", [mine, 10.2]), rep(1, "node0", [mine, 10.1]), None, None]
    clause, summary = explain(0, mine, reports, TABLE, 10.0)
    assert clause == ("not arrived: no answer from ranks 2-3 on node1 (dead, hung, or cut off: a node whose "
                      "link is down); waiting in it too: rank 1")
    assert summary[2] == "rank 2 (node1): no answer" and summary[0].startswith("rank 0 (node0): waiting 10.2 s in")


def test_ranks_elsewhere_or_in_no_collective_have_not_arrived_and_one_rank_prints_the_summary():
    mine = "all_gather of bucket 1 at step 3"
    reports = [rep(0, "node0", [mine, 9.0]), rep(1, "node0", None, ["sum_scalars", "all_gather of bucket 0 at step 3"]),
               rep(2, "node1", ["reduce_scatter of bucket 4 at step 3", 2.0]), rep(3, "node1", [mine, 5.1], fired=True)]
    clause, summary = explain(3, mine, reports, TABLE, 5.0)
    assert clause == ("not arrived: rank 1 (node0) is in no collective (computing or hung; its last: all_gather of "
                      "bucket 0 at step 3); rank 2 (node1) waits in reduce_scatter of bucket 4 at step 3; "
                      "waiting in it too: rank 0")
    assert summary == []                 # rank 0 has waited the timeout: it prints the summary
    clause0, summary0 = explain(0, mine, reports, TABLE, 10.0)    # rank 0: rank 3 fired, but 0 is lower
    assert len(summary0) == 4 and "last collectives: sum_scalars, all_gather of bucket 0 at step 3" in summary0[1]
    clause, _ = explain(0, mine, [reports[0], GONE, reports[2], reports[3]], TABLE, 10.0)
    assert clause.startswith("not arrived: rank 1 ended (nothing answers on node0); rank 2 (node1) waits in"), clause
    every = [rep(r, TABLE[r]["host"], [mine, 6.0]) for r in range(4)]
    assert explain(1, mine, every, TABLE, 10.0)[0].startswith("every rank waits in it (the data does not arrive")


def test_reporters_answer_over_tcp_with_the_token_only():
    record = WaitRecord()
    reporter = Reporter(record, 0, step=lambda: 4, fired=lambda: False)
    try:
        address = reporter.address()
        with record("sum_scalars"):
            time.sleep(0.05)
            got = ask_one(address, True, 2.0)
        assert got["waiting"][0] == "sum_scalars at step 4" and got["last"] == [] and got["rank"] == 0
        assert ask_one(dict(address, token="0" * 16), True, 2.0) is None
        assert ask_one(address, True, 2.0)["last"] == ["sum_scalars"]
    finally:
        reporter.close()
    assert ask_one(address, True, 2.0) == GONE      # nothing listens any more: the process ended


def test_a_fired_watchdog_names_who_had_not_arrived():
    records = [WaitRecord(), WaitRecord()]
    reporters = [Reporter(records[r], r, step=lambda: 7, fired=lambda: False) for r in range(2)]
    table = [r.address() for r in reporters]
    codes = []
    dog = Watchdog(records[0], 0.3, rank=0, step=lambda: 7, abort=codes.append)
    dog.peers = Peers(reporters[0], table, 0)
    try:
        with records[0]("all_gather", (4, 7)):
            end = time.monotonic() + 10
            while not codes and time.monotonic() < end:
                time.sleep(0.02)
        assert codes == [EXIT_TIMEOUT]
        assert "all_gather of bucket 4 at step 7" in dog.fired
        assert "not arrived: rank 1 (" in dog.fired and "is in no collective" in dog.fired, dog.fired
        assert dog.fired.endswith("; aborting the job")
    finally:
        dog.close(wait=True)
        reporters[1].close()


def test_the_banner_names_the_hosts_of_the_ranks():
    assert hosts_line(TABLE) == "node0: ranks 0-1; node1: ranks 2-3"
    assert hosts_line([{"host": "vm"}] * 3) == ""


def test_a_big_job_names_a_few_ranks_and_summarizes_in_a_few_lines():
    mine = "reduce_scatter of bucket 0 at step 2"
    table = [{"host": f"node{r // 8}"} for r in range(64)]
    reports = [rep(r, table[r]["host"], [mine, 9.0]) for r in range(64)]
    for r in range(40, 60):
        reports[r] = rep(r, table[r]["host"], ["all_gather of bucket 1 at step 2", 1.0])
    clause, summary = explain(0, mine, reports, table, 5.0)
    assert clause.count(" waits in all_gather") == 8 and "12 more ranks elsewhere" in clause, clause
    assert len(summary) == 17 and summary[-1] == "48 more ranks not shown", summary
    assert summary[1].startswith("rank 40 (node5): waiting 1.0 s in all_gather")   # those elsewhere first


def test_ranks_are_named_by_their_world_rank():
    """Round-robin ranks are numbered node by node in the engine; the lines name the world's."""
    mine = "all_gather of bucket 0 at step 1"
    table = [{"host": "node0", "rank": 0}, {"host": "node0", "rank": 2}, {"host": "node1", "rank": 1},
             {"host": "node1", "rank": 3}]
    reports = [rep(0, "node0", [mine, 9.0]), rep(2, "node0", [mine, 9.0]), None, None]
    clause, summary = explain(0, mine, reports, table, 5.0)
    assert "no answer from ranks 1, 3 on node1" in clause and "waiting in it too: rank 2" in clause, clause
    assert [line.split(" (")[0] for line in summary] == ["rank 0", "rank 1", "rank 2", "rank 3"], summary
    assert summary[1] == "rank 1 (node1): no answer"
    assert hosts_line(table) == "node0: ranks 0, 2; node1: ranks 1, 3"
