"""Quiet library output in engine processes: no weight-loading bars per worker, no graph teardown chatter.

Warnings and errors still come through; ``RAYSAMPLE_VERBOSE=1`` keeps everything.
"""

from __future__ import annotations

import logging
import os


def quiet_libraries() -> None:
    if os.environ.get("RAYSAMPLE_VERBOSE"):
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("ray.dag").setLevel(logging.WARNING)
