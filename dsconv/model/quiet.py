"""transformers kept quiet while dsconv drives it: its progress bars and info chatter would bury dsconv's own."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or info chatter from transformers while dsconv drives it (restored afterwards)."""
    import warnings

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
