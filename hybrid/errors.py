"""The one exception type for a user's mistake (flag, file, value)."""


class ConfigError(ValueError):
    """A user's mistake in flags, files or values.

    Entry scripts catch it, print its message alone (no traceback) and exit non-zero, so the
    message must name the flag or file, what was expected, and what to do.
    """
