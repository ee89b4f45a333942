"""Ctrl-C outside main() as inside it (support.errors.run_main): one line and exit 130, not a
traceback of the import in flight (torch's takes seconds). Every script imports this first, before
any package (tests/test_signals.py); run_main lends main() the KeyboardInterrupt (`raised`) for its
own handlers (train.py's StopSignals). Imported by other than the program's main module (a test
importing a script) it changes nothing.
"""
import contextlib
import os
import signal
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT


def say(line):
    """One line on stderr, from rank 0 only: under torchrun every rank stops alike."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def stop(signum, frame):
    """os._exit: an exception could be swallowed by an import's `except BaseException`."""
    if sys.modules.get("__main__") is not OWNER:  # a script run by runpy (tests) has ended
        signal.default_int_handler(signum, frame)
    say("interrupted")
    os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def raised():
    """Ctrl-C within is KeyboardInterrupt; `stop` again after, up to the process's exit."""
    ours = signal.getsignal(signal.SIGINT) is stop
    if ours:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ours:
            signal.signal(signal.SIGINT, stop)


_frame = sys._getframe()  # up past this module and importlib to the import statement's module
while _frame.f_globals.get("__name__", "").startswith((__name__, "importlib")):
    _frame = _frame.f_back
OWNER = sys.modules["__main__"] if _frame.f_globals.get("__name__") == "__main__" else None
# not over SIG_IGN: a shell's background job ignores Ctrl-C, and goes on ignoring it
if OWNER is not None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, stop)
