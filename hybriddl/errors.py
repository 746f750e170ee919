"""Errors the user can fix. The CLI turns them into one line and exit code 2."""


class UsageError(Exception):
    """Bad input: the message says what is wrong and what to do about it."""


class TrainingError(Exception):
    """Training could not go on (non-finite loss, a failed host, ...)."""
