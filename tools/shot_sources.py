"""Show the window opening a Hub id and a training config, for screenshots under a real X server (e.g. Xvfb:
run one of these, and after 8-12 s take the screen with ImageMagick's ``import -window root out.png``).

    .venv/bin/python tools/shot_sources.py hub-fetching
    .venv/bin/python tools/shot_sources.py hub
    .venv/bin/python tools/shot_sources.py config

No network: the "Hub" is the test suite's local server (tests/support/hub_server.py) serving
``demo/Llama-3.1-8B`` (the published Llama-3.1-8B config.json, four safetensors shards whose headers are real
and whose 16 GB of data are zeros made up on demand; only the headers are ever asked for). ``hub-fetching``
slows each answer so that the lookup's progress row is on screen; ``hub`` shows the result; ``config``
opens tests/fixtures/training/axolotl_qlora_zero2.yaml (with its DeepSpeed JSON) and the mapping panel.
Caches and settings go to a temporary folder.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}


def _demo_repo(delay_s: float):  # noqa: ANN202
    from tests.support.hub_server import Repo, tiny_tensors, virtual_safetensors

    shapes = tiny_tensors(LLAMA31_8B)
    names = list(shapes)
    parts = [names[i::4] for i in range(4)]
    files, virtual, weight_map = {"config.json": json.dumps(LLAMA31_8B).encode()}, {}, {}
    total = 0
    for k, part in enumerate(parts, 1):
        fname = f"model-{k:05d}-of-00004.safetensors"
        head, size = virtual_safetensors({n: shapes[n] for n in part})
        virtual[fname] = (head, size)
        total += size - len(head)
        weight_map |= dict.fromkeys(part, fname)
    files["model.safetensors.index.json"] = json.dumps({"metadata": {"total_size": total},
                                                        "weight_map": weight_map}).encode()
    return Repo(files, "0e9e39f249a16976918f6564b8830bc894c89659", virtual=virtual, delay_s=delay_s)


def main(mode: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="vramlab-shot-"))
    os.environ["VRAMLAB_SETTINGS_FILE"] = str(tmp / "settings.ini")
    os.environ["HF_HOME"] = str(tmp / "hf")
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
    os.environ.pop("HF_HUB_OFFLINE", None)
    sys.path.insert(0, str(ROOT))
    from tests.support.hub_server import HubServer

    server = HubServer()
    server.repos["demo/Llama-3.1-8B"] = _demo_repo(0.8 if mode == "hub-fetching" else 0.0)
    os.environ["HF_ENDPOINT"] = server.start()

    from vramlab.app.main_window import MainWindow
    from vramlab.app.qt import QtCore, QtWidgets

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication(["vramlab"])
    app.setApplicationName("VRAM Lab")
    win = MainWindow(detect_gpus=False, theme_mode="light")
    win.resize(1560, 960)
    win.move(20, 20)
    win.show()

    def act() -> None:
        if mode.startswith("hub"):
            edit = win.panel.model_combo.lineEdit()
            edit.setText("demo/Llama-3.1-8B")
            edit.returnPressed.emit()
        else:
            win.open_training_configs([str(ROOT / "tests/fixtures/training/axolotl_qlora_zero2.yaml")])
            win.state.set_field("gpus", 2)
            win.resizeDocks([win.mapping_dock], [430], QtCore.Qt.Orientation.Vertical)
            win.mapping.table.scrollToBottom()

    QtCore.QTimer.singleShot(1500, act)
    code = app.exec()
    server.stop()
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "hub"))
