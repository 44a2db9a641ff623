"""Exceptions a user can cause. Each message names the file, key, flag, plugin or field."""


class PagodaError(Exception):
    """Base class of pagoda's user-facing errors."""


class PluginError(PagodaError):
    """A plugin failed to load, or something a plugin should provide is missing."""


class ConfigError(PagodaError):
    """An invalid configuration key, value, file or flag."""


class ModelLoadError(PagodaError):
    """A checkpoint that cannot be loaded: unknown architecture, missing or bad weights."""


class RequestError(PagodaError, ValueError):
    """A request that cannot be served: bad sampling parameters, prompt too long.

    ``field`` names the request field at fault (e.g. ``"temperature"``, ``"prompt"``); ``code`` is
    set for what a field's own type and range cannot say (``"invalid_combination"``: fields that
    contradict each other; ``"context_length_exceeded"``).
    """

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field = field
        self.code = code
