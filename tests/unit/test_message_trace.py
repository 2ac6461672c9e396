"""The testbed agent's per-message trace, and the message-id fields it reads."""

from dlcp.hostagent.exchange import iteration_of, message_id, step_of, tensor_of
from dlcp.hostagent.messages import MessageStats, RateChange
from dlcp.topologies.agent import message_trace, rate_trace


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
