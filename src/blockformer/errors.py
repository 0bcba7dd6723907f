"""Errors a user can fix. The command line prints them as one line and exits with code 2."""


class UsageError(ValueError):
    """Bad input: a config value, a file, a flag. The message names it and what was expected.

    A ``ValueError``, so that ``except ValueError`` catches the library's own argument checks
    as it catches the standard library's."""
