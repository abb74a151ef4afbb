"""The two errors loadtest raises at its boundary; both carry a message meant for the user."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field, its CLI flag and what is allowed."""


class LoadTestError(RuntimeError):
    """The run cannot proceed: server unreachable, wrong endpoint, server does not stream, ..."""
