"""The one place shardcast's version is written. pyproject.toml reads it (scikit-build-core's regex
metadata provider), and so does CMake (the project's VERSION and the `shardcast --version` string)."""
__version__ = "0.1.0"
