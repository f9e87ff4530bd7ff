"""The exception types the CLI turns into a one-line message.

:class:`Error` is the base of every error the CLI shows as one line
without a traceback; :class:`UserError` is the user's mistake (the message
says what was wrong and how to fix it). A fault that is not the user's (a
peer that died, a network that failed) derives from :class:`Error` but not
from :class:`UserError`.
"""


class Error(Exception):
    """An error the CLI prints as one line, without a traceback."""


class UserError(Error):
    """A mistake the user can fix; the message says what was wrong and how."""


class DataError(UserError):
    """A problem with the data a user can fix; the message says how."""
