"""The package version (a leaf module)."""

__version__ = "0.1.0"
