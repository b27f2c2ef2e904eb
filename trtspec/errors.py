"""The project's error types. The CLI prints any `TrtspecError` as one line and exits 1; every other
exception is a bug and keeps its traceback.

Each keeps the builtin base it had before (ValueError / RuntimeError), so callers that caught those
keep working.
"""
from __future__ import annotations


class TrtspecError(Exception):
    """A problem the user can fix; the message names it and the fix."""


class ConfigError(TrtspecError, ValueError):
    """A config (YAML) or an option in it that trtspec cannot use."""


class RequestError(TrtspecError, ValueError):
    """A request the runtime refuses: empty prompt, bad sampling settings, a strategy it cannot run."""


class Terminated(BaseException):
    """SIGTERM, raised (where a command installs the handler) so that cleanup runs on the way out.
    A BaseException like KeyboardInterrupt: nothing catches it by accident."""
