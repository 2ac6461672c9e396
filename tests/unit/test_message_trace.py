"""The testbed agent's per-message trace, and the message-id fields it reads."""

from dlcp.hostagent.exchange import iteration_of, message_id, step_of, tensor_of
from dlcp.hostagent.messages import MessageStats, RateChange
from dlcp.topologies.endpoint_logs import LOG_SLACK, message_trace, rate_trace, recent
from dlcp.topologies.runner import LineCounter


def test_message_id_fields_come_back_out():
    for it, tensor, step in ((0, 0, 0), (5, 3, 1), (1023, 65535, 63), (1030, 7, 5)):
        mid = message_id(it, tensor, step)
        assert (iteration_of(mid), tensor_of(mid), step_of(mid)) == (it % 1024, tensor, step)


def test_trace_keeps_the_iterations_messages_in_order_of_start_with_times_from_its_start():
    def stats(direction, it, tensor, step, started, first, finished, retx=0):
        return MessageStats(peer=1, message_id=message_id(it, tensor, step), direction=direction, elements=714,
                            packets=2, bytes=2944, loss_bound=0.0, retransmissions=retx, started=started,
                            first_arrival=first, finished_at=finished)

    log = [stats("send", 3, 4, 1, 10.020, None, 10.030, retx=1),
           stats("recv", 3, 4, 0, 10.005, 10.008, 10.012),
           stats("recv", 2, 4, 0, 9.5, 9.6, 9.7),      # another iteration
           stats("recv", 3, 0, 0, 9.99, 9.995, 10.0)]  # this iteration's id, but started before it (a wrap)
    rows = message_trace(log, 3, 10.0)
    assert rows == [["recv", 1, 4, 0, 2, 0, 5.0, 8.0, 12.0], ["send", 1, 4, 1, 2, 1, 20.0, None, 30.0]]


def test_rate_trace_keeps_the_window_in_packets_per_second():
    log = [RateChange(9.99, 4, 3000.0, "start"), RateChange(10.002, 4, 1500.0, "marks"),
           RateChange(10.5, 4, 3000.0, "increase")]
    assert rate_trace(log, 1500, 10.0, 10.1) == [[2.0, 4, 1.0, "marks"]]
    assert rate_trace(log, 1500, 10.0) == [[2.0, 4, 1.0, "marks"], [500.0, 4, 2.0, "increase"]]


def test_recent_returns_the_logs_tail_from_the_slack_before_since_and_reads_no_further():
    log = [RateChange(float(t), 1, 1.0, "x") for t in range(100)]
    seen = []

    def time_of(c: RateChange) -> float:
        seen.append(c.time)
        return c.time

    tail = recent(log, 90.0, time_of)
    assert [c.time for c in tail] == [t for t in range(100) if t >= 90 - LOG_SLACK]
    assert min(seen) == 90 - LOG_SLACK - 1  # the first entry too old stops the walk
    assert recent(log, 1000.0, time_of) == [] and recent([], 0.0, time_of) == []
    # a trace from the tail equals one from the whole log
    assert rate_trace(tail, 1500, 90.0) == rate_trace(log, 1500, 90.0)


def test_line_counter_counts_lines_appended_between_reads(tmp_path):
    path = tmp_path / "worker0.jsonl"
    counter = LineCounter(path)
    assert counter.count() == 0  # not written yet
    with open(path, "w") as f:
        f.write('{"a": 1}\n{"b"')
        f.flush()
        assert counter.count() == 1
        f.write(': 2}\n\n')
        f.flush()
        assert counter.count() == 3
        assert counter.count() == 3
