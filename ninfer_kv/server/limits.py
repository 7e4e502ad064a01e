"""The server's default limits (a module of constants: the command line reads them without importing
FastAPI)."""

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_SHUTDOWN_GRACE"]

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
"""Largest request body (bytes) unless the server says otherwise."""
DEFAULT_SHUTDOWN_GRACE = 30.0
"""Seconds running requests get to finish after SIGTERM before they are aborted."""
