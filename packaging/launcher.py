"""PyInstaller's entry script: the frozen ``vramlab`` executable is ``vramlab.app.entry.main``.

No arguments opens the GUI; ``estimate|simulate|profile|fit|gpus`` run the CLI; ``--profile-child`` and
``--self-test`` are described in app/entry.py.
"""

import sys

from vramlab.app.entry import main

if __name__ == "__main__":
    sys.exit(main())
