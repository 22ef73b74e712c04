"""The one exception type for bad user input: the CLI prints it on one line and exits with code 2."""


class KvbenchError(Exception):
    """A problem with what the user asked for (a name, a value, a path), not a bug in kvbench."""
