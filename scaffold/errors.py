"""The one error hierarchy of scaffold.

Library code raises these; `scaffold._cli` turns each into one `error: ...` line on stderr and
its `exit_code`. Anything else escaping the library is a bug and keeps its traceback.
"""


class ScaffoldError(Exception):
    """A failure the user can act on: its message is shown as is, without a traceback."""

    exit_code = 1


class UsageError(ScaffoldError):
    """The command line asked for something invalid; nothing was written or changed."""

    exit_code = 2


class InvalidAnswerError(UsageError):
    """An answer is not one of the question's choices, fails its validator, or mixes badly."""

    def __init__(self, message: str, question: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.question = question  # the refused question, where copier named it
        self.reason = reason  # copier's reason, without the question or the value


class DestinationError(UsageError):
    """The destination cannot take a new project without losing what is there."""


class Interrupted(ScaffoldError):
    """Ctrl-C or SIGTERM stopped the command; whatever was half-done has been removed."""

    exit_code = 130
