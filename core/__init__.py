"""VRAM Lab core: the setup model, the estimator, the measuring levels and the CLI.

Pure Python and torch only. This package never imports Qt or pyqtgraph, the estimator never imports torch,
and nothing but the app's entry point imports the CLI: import-linter contracts in pyproject.toml, run by
`make lint`, fail the build otherwise. So everything here runs headless and in CI.
"""

__version__ = "0.1.0"
