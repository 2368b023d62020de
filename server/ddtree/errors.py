"""User-facing errors: raised with a one-line message that the CLI and the server show as is."""


class DDTreeError(Exception):
    """A problem with what the user asked for (bad path, mismatched model pair, bad argument)."""
