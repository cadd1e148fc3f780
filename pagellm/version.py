"""The package version, below everything that reports it (the CLI, the server)."""
__version__ = "0.1.0"
