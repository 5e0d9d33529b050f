"""The three ways a dsconv command can end badly, each mapped to one exit code (README: exit codes).

UserError (exit 2): the user's input or options are wrong. CheckFailed (exit 3): a check the user asked for
(numeric parity, balance, fit) failed. Both print one line - what, where, what to do - and never a traceback.
Anything else is a bug (exit 1): the CLI prints the traceback and asks for a report.
"""
from __future__ import annotations


class DsconvError(Exception):
    """Base of the errors the CLI turns into a one-line message and an exit code."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None, details: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details  # extra lines (figures, per-rank reasons) shown under the message

    def __str__(self) -> str:
        return self.one_line()

    def __reduce__(self):
        """Pickled whole (hint and details too): a task's error crosses process and host boundaries
        (dsconv.executor)."""
        return (type(self), (self.message, self.hint, self.details))

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        if self.hint:
            text += f"; {self.hint}"
        return " ".join(text.split("\n"))


class UserError(DsconvError):
    """The input or the options are wrong: exit 2, one line naming the file/line/tensor and the fix."""

    exit_code = 2


class CheckFailed(DsconvError):
    """A check the user asked for failed (parity, balance, fit): exit 3, nothing written."""

    exit_code = 3


def warn(message: str) -> None:
    """A warning on stderr (never stdout, which `--json` keeps for one object); any layer may call it."""
    import click

    click.echo(f"warning: {message}", err=True)


# ---- Ctrl-C that nothing may swallow ---------------------------------------------------------------------------
#: set by the CLI's SIGINT handler: a KeyboardInterrupt raised where CPython ignores exceptions (a weakref callback
#: of the import machinery, a __del__) is lost, but the output it interrupted must still not appear
_interrupted: list[bool] = []


def install_interrupt_flag() -> None:
    """SIGINT records itself before raising KeyboardInterrupt as Python's own handler does (main thread only, and
    only where SIGINT has Python's default handler: an ignored SIGINT stays ignored)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def handler(signum: int, frame: object) -> None:
        _interrupted.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a Ctrl-C arrived, even one whose exception something swallowed: called before an output
    is renamed into place."""
    if _interrupted:
        raise KeyboardInterrupt
