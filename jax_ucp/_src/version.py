"""The package version, in a module of its own so any layer can record it without a cycle."""

__version__ = "0.1.0"
