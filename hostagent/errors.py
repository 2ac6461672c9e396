"""Exceptions a user can cause and fix, shared by the agent, the controller and the CLIs.

Command-line tools print a :class:`DlcpUserError` as one line and exit non-zero, without a
traceback; anything else is a bug and is reported with the log path.
"""


class DlcpUserError(Exception):
    """A mistake in what the user asked for or configured; the message says what to change."""

    exit_code = 1


class UsageError(DlcpUserError):
    """A command was called the wrong way."""

    exit_code = 2
