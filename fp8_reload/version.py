"""The package version: one place, read by `fp8_reload.__version__`, `fp8-reload --version`
and the build (pyproject.toml reads it without importing the package)."""

__version__ = "0.1.0"
