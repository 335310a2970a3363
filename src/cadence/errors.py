"""The one exception type users see: a clear message, no traceback from the CLI."""


class CadenceError(Exception):
    """A user-facing error (bad path, bad checkpoint, bad input). The CLI prints it and exits 2."""
