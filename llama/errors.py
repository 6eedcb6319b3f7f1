"""The one exception type for mistakes a user can fix: bad files, bad arguments, a missing device."""


class LlamaError(ValueError):
    """A problem with the user's input, said in one sentence that tells them what to fix.

    The command-line tools print its message on one line and exit non-zero; library callers can catch it
    (or ValueError, which it subclasses, as Meta's reference raises for the same mistakes).
    """


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line, or its type's name where it has none: the reason part of a
    one-line error about a failure from below (a compiler, a loader, a file)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
