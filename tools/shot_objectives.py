"""Screenshots of SFT / DPO / GRPO side by side for one 7B model on a 24 GB and an 80 GB GPU (issue 15).

    xvfb-run -a .venv/bin/python tools/shot_objectives.py docs/screenshots

Writes objectives-24gb.png and objectives-80gb.png (the chart, device level, with the GPU's line),
objectives-*-table.png (the comparison table) and objectives-setup.png (the setup panel with GRPO's settings
and the phases) for Llama-2-7B, LoRA r16 on all linear layers, bf16, batch 4 x 2048 tokens, checkpointing;
DPO with its reference as TRL sets it up (adapters disabled), GRPO with 4 generations of 1024 tokens after a
1024-token prompt. Runs on a real X server when DISPLAY is set, offscreen otherwise; settings go to a
temporary file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "docs/screenshots")
    out.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ["VRAMLAB_SETTINGS_FILE"] = str(Path(tempfile.mkdtemp(prefix="vramlab-shots-")) / "settings.ini")
    from vramlab.app.qt import QtCore, QtGui, QtWidgets

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["vramlab-shots"])
    from vramlab.app.main_window import MainWindow
    from vramlab.core.catalog import find_gpu
    from vramlab.core.result import MemLevel
    from vramlab.core.spec.training import TrainingSetup

    def settle(ms: int = 200) -> None:
        deadline = time.monotonic() + ms / 1000
        while time.monotonic() < deadline:
            app.processEvents(QtCore.QEventLoop.ProcessEventsFlag.AllEvents, 20)
            time.sleep(0.01)

    def save(name: str) -> None:
        deadline = time.monotonic() + 60
        settle(100)
        while w.state.replaying and time.monotonic() < deadline:
            settle(100)
        settle(300)
        image = w.grab().toImage().convertToFormat(QtGui.QImage.Format.Format_RGB888)
        image.save(str(out / name), "PNG", 9)
        print(out / name)

    w = MainWindow(theme_mode="light")
    w.resize(1440, 860)
    w.show()
    settle(400)
    w.state.set_model("llama-2-7b")
    w.state.set_setup(TrainingSetup(method="lora", lora_targets="all-linear", lora_rank=16, micro_batch=4,
                                    seq_len=2048, grad_ckpt=True, completion_len=1024))
    w.state.set_level(MemLevel.DEVICE)
    w.state.flush()
    w.state.compare_objectives()
    w.state.flush()
    for gpu, name in (("rtx-4090", "objectives-24gb"), ("a100-80gb", "objectives-80gb")):
        w.state.set_gpu(find_gpu(gpu))
        w.state.flush()
        w.tabs.setCurrentWidget(w.breakdown)
        save(f"{name}.png")
        w.tabs.setCurrentWidget(w.comparison)
        w.comparison.table.horizontalHeader().setSectionHidden(1, True)  # the model: the same in every row
        w.comparison.table.horizontalHeader().setSectionHidden(3, True)  # the precision: likewise
        save(f"{name}-table.png")
    w.state.set_field("objective", "grpo")
    w.state.set_fields({"num_generations": 4, "beta": 0.04})
    w.state.flush()
    w.tabs.setCurrentWidget(w.phases)
    save("objectives-setup.png")
    w.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
