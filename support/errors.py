"""
The errors a user causes and can fix, as types. support/ and the scripts raise them with a message
that names the fix; each script's entry point (`run_main`) prints one `error: ...` line for them and
lets every other exception be a traceback, because anything else is a bug (in this code or a fork's).

    UserError        the base: catch this, never ValueError or RuntimeError, around user input
      ConfigError    a command line, a config file, a model shape
      CheckpointError  a run folder, a checkpoint, an export or Hugging Face folder
      DataError      a dataset, a corpus, a tokenizer

model.py imports only torch, so its config checks raise model.ConfigError (a ValueError); the entry
points treat it as a user error too (USER_ERRORS).
"""
import os
import sys

from model import ConfigError as ModelConfigError

EXIT_USER_ERROR = 1  # the status of a run stopped by bad input (a signal's is 128 + its number)


class UserError(Exception):
    """Bad input, a missing file, a damaged folder: the message names the fix."""


class ConfigError(UserError):
    """Bad input on the command line or in a config file."""


class CheckpointError(UserError):
    """A run folder, checkpoint or model folder that cannot be used as asked."""


class DataError(UserError):
    """A dataset, corpus or tokenizer that cannot be used as asked."""


class ShowHelp(Exception):
    """-h/--help: the usage text, printed by run_main, which then exits 0 (no support/ module
    ends the process)."""


USER_ERRORS = (UserError, ModelConfigError)


def run_main(main, argv=None):
    """Run a script's main(argv): a user error is its one line on stderr (rank 0's, under
    torchrun) and EXIT_USER_ERROR; anything else is a traceback."""
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except ShowHelp as e:
        print(e)
        sys.exit(0)
    except USER_ERRORS as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops alike: one line
            print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
