"""Quiet library output in engine processes: no weight-loading bars per worker, no graph teardown chatter,
nothing from the interpreter's teardown.

Warnings and errors still come through; ``RAYSAMPLE_VERBOSE=1`` keeps everything.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys


def quiet_libraries() -> None:
    if os.environ.get("RAYSAMPLE_VERBOSE"):
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("ray.dag").setLevel(logging.WARNING)


def quiet_teardown() -> None:
    """After this process's last exit handler, its output goes nowhere. An engine actor that imported
    Triton (torch's tensor-parallel code does) otherwise prints nanobind's list of "leaked" objects when
    the interpreter tears its modules down, some 60 lines of it into the driver's log: the process is
    ending, so nothing there is a leak anyone can act on. Registered as the actor starts, the hook runs
    after the exit handlers of what the actor loads later (exit handlers run last-in, first-out), and the
    exit code is unchanged."""
    if os.environ.get("RAYSAMPLE_VERBOSE"):
        return

    def silence() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed already
                pass
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)

    atexit.register(silence)
