"""Where the tool keeps what it fetches: one per-user directory that an environment variable can move."""

import os
from pathlib import Path

HOME_ENV = "LLAMA_HOME"


def home_dir() -> Path:
    """The per-user directory for downloaded models and tokenizers.

    `$LLAMA_HOME` when set, else `$XDG_CACHE_HOME/llama-kv`, else `~/.cache/llama-kv`. Not created here.
    """
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama-kv"
