"""Intra-op threads follow the CPU share, capped by the cores this process may use."""

import torch

from workers.step.threads import set_cpu_threads, usable_cores


def test_threads_follow_the_share_and_never_exceed_the_cores():
    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(1.0) == 1 == torch.get_num_threads()
        assert set_cpu_threads(0.5) == 1  # a fraction of a core is still one thread
        assert set_cpu_threads(1000.0) == usable_cores() == torch.get_num_threads()
        assert set_cpu_threads() == usable_cores()
    finally:
        torch.set_num_threads(before)
