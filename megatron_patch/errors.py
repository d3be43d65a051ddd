"""The one exception type users see: its message is a single line that says what to change."""


class UserError(Exception):
    """Bad input or an impossible configuration; the CLI prints it on one line and exits non-zero.

    Names taken from the input (a tensor, a file, a tracker's text) may hold line breaks: they are written
    as ``\\n`` so the message stays one line whatever it quotes."""

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str):
            args = (args[0].replace("\r", "\\r").replace("\n", "\\n"),)
        super().__init__(*args)
