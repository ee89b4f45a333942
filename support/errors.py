"""
The errors a user causes and can fix, as types. support/ and the scripts raise them with a message
that names the fix; each script's entry point (`run_main`) prints one `error: ...` line for them and
lets every other exception be a traceback, because anything else is a bug (in this code or a fork's).

    UserError        the base: catch this, never ValueError or RuntimeError, around user input
      ConfigError    a command line, a config file, a model shape
      CheckpointError  a run folder, a checkpoint, an export or Hugging Face folder
      DataError      a dataset, a corpus, a tokenizer
      DiskFull       a write that found no room (support.atomic.room_for raises it)

model.py imports only torch, so its config checks raise model.ConfigError (a ValueError), the base
of ConfigError here: `except ConfigError` from either module catches both, and the entry points
print model.py's as a user error too (USER_ERRORS).
"""
import math
import os
import sys

from model import ConfigError as ModelConfigError
from support.interrupt import EXIT_INTERRUPTED, raised, say

# The status of a run stopped by bad input: 2, a usage error's, as argparse's (1 is left to bugs, a
# traceback); a signal's is 128 + its number: Ctrl-C 130 (support.interrupt's), a closed pipe 141.
EXIT_USER_ERROR = 2
EXIT_CLOSED_PIPE = 141


class UserError(Exception):
    """Bad input, a missing file, a damaged folder: the message names the fix."""


class ConfigError(UserError, ModelConfigError):
    """Bad input on the command line or in a config file; a model.ConfigError, as a model's bad
    shape is."""


class CheckpointError(UserError):
    """A run folder, checkpoint or model folder that cannot be used as asked."""


class DataError(UserError):
    """A dataset, corpus or tokenizer that cannot be used as asked."""


class DiskFull(UserError):
    """A write that found no room (a full disk or quota, a file-size limit), nothing of it left:
    the path and the megabytes it needs (more: at least that many, all that is known)."""

    def __init__(self, path, need, more=False):
        self.free = f"free {'more than ' if more else ''}{max(1, math.ceil(need / 1e6))} MB"
        super().__init__(f"cannot write {path}: no space left on device; {self.free} or pick "
                         f"another path")


class ShowHelp(Exception):
    """-h/--help: the usage text, printed by run_main, which then exits 0."""


USER_ERRORS = (UserError, ModelConfigError)


def run_main(main, argv=None) -> int:
    """main(argv)'s exit status for `sys.exit(run_main(main))` (no support/ module ends the
    process): a user error or Ctrl-C prints one line on stderr (Ctrl-C's says what is kept), a
    reader that closed the pipe (`| head`) nothing; anything else is a traceback."""
    try:
        with raised():  # Ctrl-C: KeyboardInterrupt in main(), support.interrupt.stop around it
            main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return 0
    except ShowHelp as e:
        print(e)
        return 0
    except USER_ERRORS as e:
        say(f"error: {e}")
        return EXIT_USER_ERROR
    except KeyboardInterrupt as e:
        say(f"interrupted{f'; {e}' if str(e) else ''}")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader wanted no more; the interpreter's last flush of stdout would fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE
