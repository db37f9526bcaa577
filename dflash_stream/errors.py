"""The one exception family the CLI prints as a single line instead of a traceback."""


class DFlashError(Exception):
    """Something the user can fix (a config key, a path, a store made by another config), said in one line."""


class ConfigError(DFlashError, ValueError):
    """A configuration problem, phrased as one line naming the key."""


def os_error_line(err: OSError) -> str:
    """An OSError as one line: the path and the system's reason."""
    path = f" {err.filename}" if err.filename else ""
    return f"cannot access{path}: {err.strerror or err}"
