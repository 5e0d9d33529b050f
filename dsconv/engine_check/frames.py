"""Whose code raised an exception, for the engine checks' refusals (runs in the engines' environments)."""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def raised_in(e: BaseException, roots: tuple[str, ...]) -> str:
    """The innermost frame that is the engine's ("<root>/...", relative to its package) or this check's (its file
    name), library frames (torch, safetensors, the standard library) skipped. A refusal counts as the engine's only
    when the engine's own code raised it, never a stand-in's or the check's."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    for f in reversed(frames):
        for root in roots:
            if f"/{root}/" in f and not f.startswith(str(HERE)):
                return root + "/" + f.rsplit(f"/{root}/", 1)[1]
        if Path(f).parent == HERE:
            return Path(f).name
    return frames[-1] if frames else "?"
