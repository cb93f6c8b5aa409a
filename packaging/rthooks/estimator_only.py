"""Runtime hook of the estimator-only build (no torch bundled): ``import torch`` fails with an explanation.

The finder goes last on ``sys.meta_path``, so it is asked only after every real finder has found nothing;
it then raises the ``ModuleNotFoundError`` that the import would raise anyway (``name`` is the module's,
so ``except ImportError`` / ``e.name == "torch"`` work as usual), with a message that says what to do.
Simulate and profile surface that message in the CLI and the GUI.
"""

import importlib.abc
import sys

# the same text as vramlab.app.build.NO_TORCH (kept here so that the hook imports nothing of ours)
_MESSAGE = ("this build of VRAM Lab has no torch (the estimator-only build): `simulate` and `profile` need "
            "the full build, or `pip install vramlab` in a Python environment")


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname == "torch" or fullname.startswith("torch."):
            raise ModuleNotFoundError(_MESSAGE, name=fullname)


sys.meta_path.append(_NoTorch())
