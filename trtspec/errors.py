"""The project's error types. The CLI prints any `TrtspecError` as one line and exits 1; every other
exception is a bug and keeps its traceback.

Each keeps the builtin base it had before (ValueError / RuntimeError), so callers that caught those
keep working.
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class TrtspecError(Exception):
    """A problem the user can fix; the message names it and the fix. One line, always: control
    characters a message quotes from a file (a tensor name, a key) are shown escaped."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(_CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", str(message)), *args)


class ConfigError(TrtspecError, ValueError):
    """A config (YAML) or an option in it that trtspec cannot use."""


class RequestError(TrtspecError, ValueError):
    """A request the runtime refuses: empty prompt, bad sampling settings, a strategy it cannot run."""


class Terminated(BaseException):
    """SIGTERM, raised (where a command installs the handler) so that cleanup runs on the way out.
    A BaseException like KeyboardInterrupt: nothing catches it by accident."""
