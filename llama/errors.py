"""The one exception type for mistakes a user can fix: bad files, bad arguments, a missing device."""


class LlamaError(ValueError):
    """A problem with the user's input, said in one sentence that tells them what to fix.

    The command-line tools print its message on one line and exit non-zero; library callers can catch it
    (or ValueError, which it subclasses, as Meta's reference raises for the same mistakes).
    """
