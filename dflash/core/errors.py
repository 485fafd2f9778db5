"""The one error type for what a user can fix, and how a stage reports it.

`UserError`: bad params, an unreadable or inconsistent input file, a missing upstream output, a crossed
data-quality gate. Its message names the file, the row and the key, and says what to do. Stages
(`dflash.core.cli.run`) print it without a traceback and exit with `exit_code`. Anything else that escapes
a stage is a bug in this code (or in a library) and shows its full traceback, so a pyarrow or torch error
is never mistaken for bad input.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can act on; the message names file, row and key. Printed without a traceback."""

    exit_code = 1


class ParamsError(UserError):
    """A params file or override that does not match the schema (exit code 2, like argparse's usage errors)."""

    exit_code = 2
