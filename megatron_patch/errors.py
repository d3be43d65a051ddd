"""The one exception type users see: its message is a single line that says what to change."""


class UserError(Exception):
    """Bad input or an impossible configuration; the CLI prints it on one line and exits non-zero."""
