"""The error every command reports as one line naming the option."""


class ConfigError(ValueError):
    """A bad option: reported as one line naming the option, not a traceback."""
