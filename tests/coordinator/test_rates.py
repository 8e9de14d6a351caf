"""Windowed tokens/s: the rate of the last seconds, not a lifetime average."""

from coordinator.rates import WindowedRate


def test_rate_covers_only_the_window():
    rate = WindowedRate(window_s=10.0)
    for t in range(20):  # 100 tokens/s for 20 s
        rate.add(100, now=float(t))
    assert rate.rate(now=20.0) == 100.0 * 10 / 10.0
    assert rate.rate(now=35.0) == 0.0  # idle for longer than the window: nothing now


def test_rate_since_the_first_event_when_younger_than_the_window():
    rate = WindowedRate(window_s=10.0)
    rate.add(50, now=100.0)
    rate.add(50, now=101.0)
    assert rate.rate(now=102.0) == 50.0  # 100 tokens in 2 s, not in 10 s
    lifetime_started = 0.0
    assert rate.rate(now=102.0) > 100 / (102.0 - lifetime_started)  # a lifetime average would say 0.98
