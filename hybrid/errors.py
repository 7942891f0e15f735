"""The one exception type for a user's mistake (flag, file, value)."""


class ConfigError(ValueError):
    """A user's mistake in flags, files or values.

    Entry scripts catch it, print its message alone (no traceback) and exit non-zero, so the
    message must name the flag or file, what was expected, and what to do.
    """


class NonFiniteError(ConfigError):
    """Training met a non-finite loss or gradient norm (--check-for-nan-in-loss-and-grad): one message,
    the iteration, the last good checkpoint and what to try; nothing is saved after it."""
