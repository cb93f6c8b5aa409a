"""VRAM Lab core: the setup model, the estimator, the measuring levels and the CLI.

Pure Python and torch only. This package never imports Qt or pyqtgraph (an import-linter contract in
pyproject.toml fails the build if it does), so everything here runs headless and in CI.
"""

__version__ = "0.1.0"
