"""The one exception type the CLI turns into a one-line message."""


class UserError(Exception):
    """A mistake the user can fix; the message says what was wrong and how."""


class DataError(UserError):
    """A problem with the data a user can fix; the message says how."""
