"""Errors a user can fix. The command line prints them as one line and exits with code 2."""


class UsageError(Exception):
    """Bad input: a config value, a file, a flag. The message names it and what was expected."""
