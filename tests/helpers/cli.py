"""`batchgate ARGS` run through click's CliRunner in the test process: the exit status and
what the command printed, as a subprocess would give them, without a new interpreter's
start-up (~1 s each). For what returns promptly (validation, policy, submit, show); a
command that serves until signalled (consumer, gateway) or a test of signals and exit on
a crash needs the real process (helpers/processes.py)."""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass

from click.testing import CliRunner

from batchgate.cli import main


@dataclass
class Ran:
    """subprocess.CompletedProcess's fields that the tests read."""

    returncode: int
    stdout: str
    stderr: str


def batchgate(*args: str, input: str | None = None) -> Ran:
    """Run `batchgate *args`. Logging goes to the command's stderr as in the CLI (its
    --log-level sets it up): the root logger is handed over for the call, then restored,
    and so are the signal handlers a command may install (`consumer` does, before a
    policy conflict ends it). An exception the command did not handle exits 1 with its
    traceback on stderr, as a Python process would."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    root.handlers = []
    try:
        result = CliRunner().invoke(main, list(args), input=input)
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        for sig, handler in signals.items():
            signal.signal(sig, handler)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return Ran(result.exit_code, result.stdout, stderr)
