"""The setup panel: every fact of a training run, editable, bound to :class:`~vramlab.app.state.AppState`.

Each control writes one field of the setup (``state.set_field``); whenever the state changes the panel
re-reads all fields (with signals blocked), so the controls always show exactly what will be estimated —
including the settings a precision preset fills in, which stay visible and editable (the preset selector
then shows "Custom"). The panel never validates: the core does, and the window shows its message.

The objective's section is :class:`.setup_objective.ObjectiveSection`; the control factories and every
control's tooltip are in :mod:`.setup_controls`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vramlab.app.gpus import Detection, catalogue
from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.state import AppState, ModelChoice
from vramlab.app.views.setup_controls import (
    OBJECTIVE_LABELS,
    TARGET_LABELS,
    TIPS,
    combo,
    enum_items,
    kernel_combo,
    liger_kernel_items,
    loss_kernel_items,
    select_data,
    spin,
    unsloth_kernel_items,
)
from vramlab.app.views.setup_objective import ObjectiveSection
from vramlab.core.catalog import find_gpu, models
from vramlab.core.checks import SetupError
from vramlab.core.spec.gpu import GpuSpec
from vramlab.core.spec.liger import LIGER_DEFAULT, LIGER_KERNELS, parse_liger_kernels
from vramlab.core.spec.options import (
    ActivationOffload,
    Attention,
    DType,
    LossKernel,
    Method,
    Objective,
    Offload,
    Optimizer,
    OptimizerImpl,
    Sharding,
)
from vramlab.core.spec.presets import PRECISION_PRESETS
from vramlab.core.spec.targets import ALL_TARGETS, ATTN_TARGETS, MLP_TARGETS
from vramlab.core.spec.training import MAX_LORA_ALPHA, SETUP_BOUNDS
from vramlab.core.spec.unsloth import UNSLOTH_DEFAULT, UNSLOTH_LORA, parse_unsloth_kernels
from vramlab.core.spec.unsloth_loss import DEFAULT_GPU as DEFAULT_UNSLOTH_GPU
from vramlab.core.spec.unsloth_loss import fused_loss_runs, unsloth_gpu_free
from vramlab.core.units import GiB, fmt_bytes, fmt_count

KERNEL_SETS = {"liger_kernels": parse_liger_kernels, "unsloth_kernels": parse_unsloth_kernels}
BOUNDS = SETUP_BOUNDS  # the spin boxes take the core's ranges: a value the core accepts is one they can show


def is_hub_id(text: str) -> bool:
    """``org/name[@revision]`` that is neither a preset nor an existing local path: looked up off-thread."""
    from pathlib import Path

    from vramlab.core.catalog import find_model
    from vramlab.core.sources.hub import parse_hub_id

    text = text.strip()
    return parse_hub_id(text) is not None and find_model(text) is None and not Path(text).expanduser().exists()

CUSTOM_GPU = "custom"


class SetupPanel(ObjectiveSection, QtWidgets.QScrollArea):
    """All setup controls in one scrollable column."""

    openConfigRequested = QtCore.Signal()
    openFolderRequested = QtCore.Signal()
    errorRaised = QtCore.Signal(str)  # a model name or GPU size that could not be used
    hubLookupRequested = QtCore.Signal(str)  # a Hub id typed or picked: the window looks it up off-thread
    hubCancelRequested = QtCore.Signal()

    def __init__(self, state: AppState, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        self.state = state
        self._syncing = False
        self._gpu_specs: list[GpuSpec] = []
        self._detected: Detection = Detection((), "")
        self._imported: list[ModelChoice] = []
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(QtCore.Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QtWidgets.QFrame.Shape.NoFrame)
        body = QtWidgets.QWidget()
        self.setWidget(body)
        self._col = QtWidgets.QVBoxLayout(body)
        self._col.setContentsMargins(6, 6, 10, 6)
        self._col.setSpacing(8)
        self._controls: dict[str, QtWidgets.QWidget] = {}
        self._build_model()
        self._build_precision()
        self._build_objective()
        self._build_optimizer()
        self._build_lora()
        self._build_batch()
        self._build_vision()
        self._build_hardware()
        self._col.addStretch(1)
        self._fill_gpus()
        state.inputsChanged.connect(self.sync)
        state.computed.connect(self._on_computed)
        self.sync()
        self.fit_width()

    MIN_WIDTH = 330

    def fit_width(self) -> int:
        """Wide enough for the controls' own minimum: the panel scrolls vertically only, so a row wider than it
        would be cut off (at 330 px a real X server clipped the model row's "Open..." button). Computed once: the
        texts that change with the setup wrap instead of widening it (tests/gui/test_layout.py shows every
        objective's settings). Refitting after each change, from an event filter or after each sync, made the
        next window's theme change crash now and then (PySide6 6.11.3, a segmentation fault in the GUI tests)."""
        body = self.widget()
        need = max(self.MIN_WIDTH, body.minimumSizeHint().width() + self.verticalScrollBar().sizeHint().width() + 2)
        if need != self.minimumWidth():
            self.setMinimumWidth(need)
        return need

    # ---- building --------------------------------------------------------------------------------------------
    def _group(self, title: str, tip: str = "") -> QtWidgets.QFormLayout:
        box = QtWidgets.QGroupBox(title)
        box.setToolTip(tip)
        form = QtWidgets.QFormLayout(box)
        form.setFieldGrowthPolicy(QtWidgets.QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.setLabelAlignment(QtCore.Qt.AlignmentFlag.AlignRight | QtCore.Qt.AlignmentFlag.AlignVCenter)
        form.setContentsMargins(8, 8, 8, 8)
        form.setVerticalSpacing(5)
        self._col.addWidget(box)
        return form

    def _bind(self, name: str, widget: QtWidgets.QWidget) -> QtWidgets.QWidget:
        """Connect a control to the field ``name`` of the setup."""
        self._controls[name] = widget
        widget.setObjectName(f"field:{name}")
        if name in TIPS and not widget.toolTip():
            widget.setToolTip(TIPS[name])
        write: Callable[..., None]
        if isinstance(widget, QtWidgets.QComboBox):
            def write(_i: int, w: QtWidgets.QComboBox = widget) -> None:
                self._write(name, w.currentData())
            widget.currentIndexChanged.connect(write)
        elif isinstance(widget, QtWidgets.QCheckBox):
            def write(_s: int, w: QtWidgets.QCheckBox = widget) -> None:
                self._write(name, w.isChecked())
            widget.toggled.connect(write)
        elif isinstance(widget, QtWidgets.QDoubleSpinBox):
            def write(v: float) -> None:
                self._write(name, None if name == "lora_alpha" and v == 0 else float(v))
            widget.valueChanged.connect(write)
        elif isinstance(widget, QtWidgets.QSpinBox):
            def write(v: int) -> None:
                self._write(name, int(v))
            widget.valueChanged.connect(write)
        return widget

    def _write(self, name: str, value: Any) -> None:
        if self._syncing:
            return
        self.state.set_field(name, value)

    def control(self, name: str) -> QtWidgets.QWidget:
        """The control bound to a setup field (tests drive the panel through these)."""
        return self._controls[name]

    def _build_model(self) -> None:
        form = self._group("Model")
        row = QtWidgets.QHBoxLayout()
        self.model_combo = QtWidgets.QComboBox()
        self.model_combo.setObjectName("model")
        self.model_combo.setEditable(True)
        self.model_combo.setInsertPolicy(QtWidgets.QComboBox.InsertPolicy.NoInsert)
        self.model_combo.setToolTip(TIPS["model"])
        self.model_combo.setMaxVisibleItems(20)
        self.model_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_combo.setMinimumContentsLength(14)
        for m in models():
            self.model_combo.addItem(f"{m.name}  ·  {fmt_count(m.param_count)}", m.id)
            self.model_combo.setItemData(self.model_combo.count() - 1, m.summary(),
                                         QtCore.Qt.ItemDataRole.ToolTipRole)
        completer = QtWidgets.QCompleter(self.model_combo.model(), self.model_combo)
        completer.setFilterMode(QtCore.Qt.MatchFlag.MatchContains)
        completer.setCaseSensitivity(QtCore.Qt.CaseSensitivity.CaseInsensitive)
        completer.setCompletionMode(QtWidgets.QCompleter.CompletionMode.PopupCompletion)
        self.model_combo.setCompleter(completer)
        self.model_combo.lineEdit().setPlaceholderText("Search models, or type a Hub id (org/name) or a path")
        self.model_combo.activated.connect(self._on_model_activated)
        completer.activated[str].connect(self._on_model_text)
        self.model_combo.lineEdit().returnPressed.connect(
            lambda: self._on_model_text(self.model_combo.lineEdit().text()))
        row.addWidget(self.model_combo, 1)
        self.open_button = QtWidgets.QToolButton()
        self.open_button.setText("Open…")
        self.open_button.setToolTip("Open a Hugging Face config.json (Ctrl+O) or a local model folder")
        self.open_button.setPopupMode(QtWidgets.QToolButton.ToolButtonPopupMode.MenuButtonPopup)
        menu = QtWidgets.QMenu(self.open_button)
        menu.addAction("Open config.json…", self.openConfigRequested.emit)
        menu.addAction("Open model folder…", self.openFolderRequested.emit)
        self.open_button.setMenu(menu)
        self.open_button.clicked.connect(self.openConfigRequested.emit)
        row.addWidget(self.open_button)
        form.addRow(row)
        self.lookup_row = QtWidgets.QWidget()
        self.lookup_row.setObjectName("HubLookup")
        lrow = QtWidgets.QHBoxLayout(self.lookup_row)
        lrow.setContentsMargins(0, 0, 0, 0)
        self.lookup_busy = QtWidgets.QProgressBar()
        self.lookup_busy.setRange(0, 0)  # busy: the number of requests is not known beforehand
        self.lookup_busy.setTextVisible(False)
        self.lookup_busy.setMaximumWidth(48)
        self.lookup_busy.setMaximumHeight(10)
        lrow.addWidget(self.lookup_busy)
        self.lookup_label = QtWidgets.QLabel()
        self.lookup_label.setObjectName("Facts")
        self.lookup_label.setWordWrap(True)
        lrow.addWidget(self.lookup_label, 1)
        self.lookup_cancel = QtWidgets.QToolButton()
        self.lookup_cancel.setText("Cancel")
        self.lookup_cancel.setToolTip("Stop the Hub lookup (the model stays as it was)")
        self.lookup_cancel.clicked.connect(self.hubCancelRequested.emit)
        lrow.addWidget(self.lookup_cancel)
        self.lookup_row.setVisible(False)
        form.addRow(self.lookup_row)
        self._hub_items: list[str] = []
        self.model_info = QtWidgets.QLabel()
        self.model_info.setObjectName("Facts")
        self.model_info.setWordWrap(True)
        self.model_info.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        form.addRow(self.model_info)

    def _build_precision(self) -> None:
        form = self._group("Method && precision", "What is trained, and in which dtypes.")
        self.preset_combo = combo([(p.label, p.id) for p in PRECISION_PRESETS] + [("Custom", None)],
                                   TIPS["preset"])
        self.preset_combo.setObjectName("preset")
        self.preset_combo.currentIndexChanged.connect(self._on_preset)
        form.addRow("Preset", self.preset_combo)
        self.preset_info = QtWidgets.QLabel()
        self.preset_info.setObjectName("Facts")
        self.preset_info.setWordWrap(True)
        form.addRow(self.preset_info)
        form.addRow("Method", self._bind("method", combo(enum_items(
            Method, {Method.FULL: "Full fine-tuning", Method.LORA: "LoRA", Method.QLORA: "QLoRA (quantized base)",
                     Method.FREEZE: "Freeze (last N layers)"}), TIPS["method"])))
        self.objective_combo = combo([(OBJECTIVE_LABELS[o], o) for o in Objective], TIPS["objective"])
        self.objective_combo.setObjectName("field:objective")
        self.objective_combo.currentIndexChanged.connect(self._on_objective)
        form.addRow("Objective", self.objective_combo)
        form.addRow("Trainable layers",
                    self._bind("trainable_layers", spin(*BOUNDS["trainable_layers"], TIPS["trainable_layers"])))
        form.addRow("Weight storage", self._bind("weights", combo(enum_items(DType), TIPS["weights"])))
        form.addRow("Compute dtype", self._bind("compute", combo(
            enum_items((DType.FP32, DType.BF16, DType.FP16)), TIPS["compute"])))
        form.addRow("Autocast (AMP)", self._bind("amp", combo(
            [("Auto", None), ("On", True), ("Off", False)], TIPS["amp"])))
        form.addRow(self._bind("master_weights", QtWidgets.QCheckBox("FP32 master weights")))
        form.addRow(self._bind("trainable_fp32", QtWidgets.QCheckBox("FP32 trainable parameters")))
        form.addRow(self._bind("double_quant", QtWidgets.QCheckBox("Double quantization (NF4)")))
        form.addRow("Adapter dtype", self._bind("adapter_dtype", combo(
            enum_items((DType.FP32, DType.BF16, DType.FP16)), TIPS["adapter_dtype"])))
        self.facts = QtWidgets.QLabel()
        self.facts.setObjectName("Facts")
        self.facts.setWordWrap(True)
        self.facts.setToolTip("What the core derives from these settings (TrainingSetup.resolved()).")
        form.addRow(self.facts)

    def _build_optimizer(self) -> None:
        form = self._group("Optimizer")
        labels = {Optimizer.ADAMW: "AdamW", Optimizer.ADAMW_8BIT: "AdamW 8-bit (bitsandbytes)",
                  Optimizer.PAGED_ADAMW_8BIT: "Paged AdamW 8-bit",
                  Optimizer.SGD: "SGD",
                  Optimizer.SGD_MOMENTUM: "SGD with momentum", Optimizer.ADAFACTOR: "Adafactor",
                  Optimizer.LION: "Lion", Optimizer.PAGED_ADAMW_32BIT: "Paged AdamW 32-bit (bitsandbytes)",
                  Optimizer.TORCHAO_ADAMW_8BIT: "AdamW 8-bit (torchao)",
                  Optimizer.TORCHAO_ADAMW_4BIT: "AdamW 4-bit (torchao)",
                  Optimizer.TORCHAO_ADAMW_FP8: "AdamW FP8 (torchao)"}
        form.addRow("Optimizer", self._bind("optimizer", combo(enum_items(Optimizer, labels), TIPS["optimizer"])))
        impl = combo([("foreach (torch default)", None)] + enum_items(
            (OptimizerImpl.FOREACH, OptimizerImpl.FUSED, OptimizerImpl.SINGLE),
            {OptimizerImpl.FOREACH: "foreach", OptimizerImpl.FUSED: "fused",
             OptimizerImpl.SINGLE: "single-tensor"}), TIPS["optimizer_impl"])
        form.addRow("Implementation", self._bind("optimizer_impl", impl))
        form.addRow(self._bind("optimizer_in_backward", QtWidgets.QCheckBox("Optimizer step in backward")))

    def _build_lora(self) -> None:
        form = self._group("LoRA", "Adapters for LoRA and QLoRA (disabled for full fine-tuning and freeze).")
        self.lora_box = form.parentWidget()
        form.addRow("Rank", self._bind("lora_rank", spin(*BOUNDS["lora_rank"], TIPS["lora_rank"])))
        alpha = QtWidgets.QDoubleSpinBox()
        alpha.setRange(0, MAX_LORA_ALPHA)
        alpha.setDecimals(1)
        alpha.setSpecialValueText("auto (2 × rank)")
        alpha.setToolTip(TIPS["lora_alpha"])
        form.addRow("Alpha", self._bind("lora_alpha", alpha))
        dropout = QtWidgets.QDoubleSpinBox()
        dropout.setRange(0.0, 0.95)
        dropout.setSingleStep(0.05)
        dropout.setDecimals(2)
        dropout.setToolTip(TIPS["lora_dropout"])
        form.addRow("Dropout", self._bind("lora_dropout", dropout))
        variants = QtWidgets.QHBoxLayout()
        variants.setSpacing(12)
        for name, text in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA"), ("lora_fa", "LoRA-FA")):
            variants.addWidget(self._bind(name, QtWidgets.QCheckBox(text)))
        variants.addStretch(1)
        form.addRow("Variants", variants)
        grid = QtWidgets.QGridLayout()
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(2)
        self.target_boxes: dict[str, QtWidgets.QCheckBox] = {}
        for i, name in enumerate(ALL_TARGETS):
            box = QtWidgets.QCheckBox(TARGET_LABELS[name])
            box.setObjectName(f"target:{name}")
            box.setToolTip(f"{name}: {TIPS['lora_targets']}")
            box.toggled.connect(self._on_targets)
            grid.addWidget(box, i // 4, i % 4)
            self.target_boxes[name] = box
        targets = QtWidgets.QWidget()
        targets.setLayout(grid)
        grid.setContentsMargins(0, 0, 0, 0)
        form.addRow("Targets", targets)
        quick = QtWidgets.QHBoxLayout()
        for text, names in (("q, v", ("q_proj", "v_proj")),
                            ("All linear", (*ATTN_TARGETS, *MLP_TARGETS))):  # fused models: their fused modules
            b = QtWidgets.QPushButton(text)
            b.setToolTip(f"Adapt {', '.join(names)}")
            b.clicked.connect(lambda _=False, n=names: self._set_targets(n))
            quick.addWidget(b)
        quick.addStretch(1)
        form.addRow("", quick)

    def _build_batch(self) -> None:
        form = self._group("Batch && activations")
        form.addRow("Micro batch", self._bind("micro_batch", spin(*BOUNDS["micro_batch"], TIPS["micro_batch"])))
        form.addRow("Sequence length",
                    self._bind("seq_len", spin(*BOUNDS["seq_len"], TIPS["seq_len"], 128, " tokens")))
        form.addRow("Grad accumulation", self._bind("grad_accum", spin(*BOUNDS["grad_accum"], TIPS["grad_accum"])))
        self.effective = QtWidgets.QLabel()
        self.effective.setObjectName("Facts")
        self.effective.setWordWrap(True)
        self.effective.setToolTip("Sequences per optimizer step: micro batch × accumulation × GPUs "
                                  "(TrainingSetup.effective_batch).")
        form.addRow("Effective batch", self.effective)
        form.addRow(self._bind("grad_ckpt", QtWidgets.QCheckBox("Gradient checkpointing")))
        form.addRow(self._bind("ckpt_offload", QtWidgets.QCheckBox("Checkpoints in host memory")))
        form.addRow("Offload activations", self._bind("offload_activations", combo(enum_items(
            ActivationOffload, {ActivationOffload.NONE: "off", ActivationOffload.TRL: "TRL",
                                ActivationOffload.AXOLOTL: "axolotl (LoRA)"}), TIPS["offload_activations"])))
        form.addRow("Attention", self._bind("attention", combo(enum_items(
            Attention, {Attention.SDPA: "sdpa (flash / mem-efficient)", Attention.EAGER: "eager"}),
            TIPS["attention"])))
        kernels = loss_kernel_items(LossKernel)
        kernel = combo([(label, k) for label, k, _tip in kernels], TIPS["loss_kernel"])
        for i, (_label, _k, tip) in enumerate(kernels):
            kernel.setItemData(i, tip, QtCore.Qt.ItemDataRole.ToolTipRole)
        form.addRow("Loss kernel", self._bind("loss_kernel", kernel))
        form.addRow("Liger kernels", self._bind("liger_kernels", kernel_combo(
            liger_kernel_items(LIGER_KERNELS, LIGER_DEFAULT), LIGER_DEFAULT, TIPS["liger_kernels"])))
        form.addRow("Unsloth kernels", self._bind("unsloth_kernels", kernel_combo(
            unsloth_kernel_items(UNSLOTH_LORA, UNSLOTH_DEFAULT), UNSLOTH_DEFAULT, TIPS["unsloth_kernels"])))
        # not a field of its own: the setup's unsloth_gpu, the chosen GPU's with the free memory given
        self.unsloth_free = QtWidgets.QDoubleSpinBox()
        self.unsloth_free.setObjectName("unsloth_free_memory")
        self.unsloth_free.setDecimals(2)
        self.unsloth_free.setSingleStep(0.5)
        self.unsloth_free.setSuffix(" GiB")
        self.unsloth_free.setSpecialValueText("auto (≥ 4 GiB)")
        self.unsloth_free.setToolTip(TIPS["unsloth_free_memory"])
        self.unsloth_free.valueChanged.connect(self._on_unsloth_free)
        form.addRow("Unsloth free memory", self.unsloth_free)
        form.addRow(self._bind("unsloth_gc", QtWidgets.QCheckBox("Unsloth checkpointing")))
        form.addRow(self._bind("hub_kernels", QtWidgets.QCheckBox("Hub kernels (transformers ≥ 5.25)")))
        form.addRow("Loss logits", self._bind("loss_fp32", combo(
            [("fp32 (transformers' upcast)", True), ("compute dtype (no upcast)", False)], TIPS["loss_fp32"])))
        chunk = QtWidgets.QHBoxLayout()
        chunk.addWidget(self._bind("chunked_loss", QtWidgets.QCheckBox("Chunked loss")))
        chunk.addWidget(self._bind("loss_chunks", spin(*BOUNDS["loss_chunks"], TIPS["loss_chunks"], suffix=" chunks")))
        chunk.addStretch(1)
        form.addRow(chunk)

    def _build_vision(self) -> None:
        """Images and video of a vision-language model's sample; shown only for such a model."""
        form = self._group("Images (vision-language model)",
                           "What one sample holds besides its text: the processor turns the images into tower "
                           "patches and language-model tokens by the model's own rules.")
        self.vision_box = form.parentWidget()
        self.vision_form = form
        form.addRow("Images per sample", self._bind("images", spin(0, 256, "Images in each sample.")))
        form.addRow("Image width", self._bind("image_width", spin(1, 32_768, "Image width before the processor "
                                                                   "resizes it.", 28, " px")))
        form.addRow("Image height", self._bind("image_height", spin(1, 32_768, "Image height before the "
                                                                     "processor resizes it.", 28, " px")))
        form.addRow("Video frames", self._bind("frames", spin(0, 4096, "Video frames per sample (0: no video).")))
        max_pixels = spin(0, 1 << 30, "The Qwen-VL processor's max_pixels (lowest: the processor's own); fewer "
                           "pixels, fewer tokens.", 28 * 28 * 64)
        max_pixels.setSpecialValueText("processor's default")  # 0 means "not set": the processor's own value
        form.addRow("Max pixels", self._bind("max_pixels", max_pixels))
        self.pan_and_scan = self._bind("pan_and_scan", QtWidgets.QCheckBox("Pan-and-scan crops"))
        self.pan_and_scan.setToolTip("Gemma 3's processor option: a wide or tall image gets up to four crops beside "
                                     "it, each one more 896 px tile for the tower and 256 tokens for the model.")
        form.addRow(self.pan_and_scan)
        form.addRow("Vision tower", self._bind("vision_tuning", combo(
            [("Frozen", "frozen"), ("Projector trained", "projector"), ("LoRA", "lora"), ("Fully trained", "full")],
            "How the vision tower and projector train: frozen (the default of LLaMA-Factory and ms-swift), the "
            "projector only, LoRA on the tower's linear layers (with --method lora), or everything (full).")))
        tower_ckpt = self._bind("vision_ckpt", QtWidgets.QCheckBox("Tower checkpointing"))
        tower_ckpt.setToolTip("With Gradient checkpointing on, checkpoint the vision tower's blocks too "
                              "(transformers' gradient_checkpointing_enable does); off keeps the tower's "
                              "activations (the CLI's --no-vision-ckpt).")
        form.addRow(tower_ckpt)
        self.vision_tokens = QtWidgets.QLabel()
        self.vision_tokens.setWordWrap(True)
        self.vision_tokens.setObjectName("vision-tokens")
        form.addRow(self.vision_tokens)

    def _sync_vision(self) -> None:
        from vramlab.core.vision import describe_tokens

        spec = self.state.model.spec
        self.vision_box.setVisible(spec.vision is not None)
        self.pan_and_scan.setVisible(spec.vision is not None and spec.vision.processor.pan_and_scan_max_crops > 0)
        qwen = spec.vision is not None and spec.vision.processor.kind == "qwen_vl"
        self.vision_form.setRowVisible(self.control("max_pixels"), qwen)  # a Qwen-VL processor setting
        setup = self.state.current_setup()
        text = describe_tokens(spec, setup) if setup is not None and spec.vision is not None else None
        self.vision_tokens.setText(text or "")

    def _build_hardware(self) -> None:
        form = self._group("GPU")
        self.gpu_combo = QtWidgets.QComboBox()
        self.gpu_combo.setObjectName("gpu")
        self.gpu_combo.setToolTip(TIPS["gpu"])
        self.gpu_combo.setMaxVisibleItems(24)
        self.gpu_combo.setSizeAdjustPolicy(QtWidgets.QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.gpu_combo.setMinimumContentsLength(14)
        self.gpu_combo.activated.connect(self._on_gpu)
        form.addRow("GPU", self.gpu_combo)
        self.detected = QtWidgets.QLabel()
        self.detected.setObjectName("Facts")
        self.detected.setWordWrap(True)
        form.addRow(self.detected)
        form.addRow("GPU count", self._bind("gpus", spin(*BOUNDS["gpus"], TIPS["gpus"])))
        form.addRow("Sharding", self._bind("sharding", combo(enum_items(
            Sharding, {Sharding.NONE: "none (data parallel)", Sharding.ZERO1: "ZeRO-1", Sharding.ZERO2: "ZeRO-2",
                       Sharding.ZERO3: "ZeRO-3", Sharding.FSDP: "FSDP"}), TIPS["sharding"])))
        form.addRow("CPU offload", self._bind("offload", combo(enum_items(
            Offload, {Offload.NONE: "none", Offload.OPTIMIZER: "optimizer states",
                      Offload.PARAMS: "parameters and optimizer"}), TIPS["offload"])))

    def _on_unsloth_free(self, gib: float) -> None:
        if self._syncing:
            return
        try:
            self.state.set_field("unsloth_gpu", unsloth_gpu_free(self.state.gpu, gib) if gib > 0 else ())
        except SetupError as e:
            self.errorRaised.emit(str(e))

    def _sync_unsloth_free(self) -> None:
        """The free memory given (auto: none), up to the chosen GPU's memory; enabled where the fused loss runs."""
        box = self.unsloth_free
        given = self.state.fields.get("unsloth_gpu") or ()
        total = self.state.gpu.memory_bytes if self.state.gpu is not None else DEFAULT_UNSLOTH_GPU[2]
        with QtCore.QSignalBlocker(box):
            box.setMaximum(int(total / GiB * 100) / 100)
            value = round(given[3] / GiB, 2) if len(given) == 4 else 0.0
            if round(box.value(), 2) != value:  # never rewrite the text the user is typing in
                box.setValue(value)
        setup = self.state.current_setup()
        box.setEnabled(setup is not None and fused_loss_runs(setup))

    # ---- GPU list ----------------------------------------------------------------------------------------------
    def set_detection(self, detection: Detection) -> None:
        self._detected = detection
        self._fill_gpus()
        self._sync_gpu()

    def _fill_gpus(self, extra: Sequence[GpuSpec] = ()) -> None:
        with QtCore.QSignalBlocker(self.gpu_combo):
            self.gpu_combo.clear()
            self._gpu_specs = []

            def add(g: GpuSpec, suffix: str = "") -> None:
                self.gpu_combo.addItem(f"{g.name}  ·  {fmt_bytes(g.memory_bytes)}{suffix}", len(self._gpu_specs))
                tip = f"{g.name}: {g.memory_bytes:,} bytes" + (f" · {g.arch}" if g.arch else "") \
                    + (f" · {g.notes}" if g.notes else "")
                self.gpu_combo.setItemData(self.gpu_combo.count() - 1, tip, QtCore.Qt.ItemDataRole.ToolTipRole)
                self._gpu_specs.append(g)

            for g in self._detected.gpus:
                add(g, "  (detected)")
            if self._detected.gpus:
                self.gpu_combo.insertSeparator(self.gpu_combo.count())
            for g in catalogue():
                add(g)
            for g in extra:
                add(g)
            self.gpu_combo.insertSeparator(self.gpu_combo.count())
            self.gpu_combo.addItem("Custom memory size…", CUSTOM_GPU)
        text = self._detected.text or "GPU detection runs after start-up."
        self.detected.setText(("Detected: " + text) if self._detected.gpus else text)

    def _sync_gpu(self) -> None:
        gpu = self.state.gpu
        if gpu is not None and gpu not in self._gpu_specs:
            customs = [g for g in self._gpu_specs if g.id.startswith("custom")] + [gpu]
            self._fill_gpus([g for g in customs if g not in catalogue() and g not in self._detected.gpus])
        with QtCore.QSignalBlocker(self.gpu_combo):
            if gpu is not None:
                select_data(self.gpu_combo, self._gpu_specs.index(gpu))

    def _on_gpu(self, index: int) -> None:
        data = self.gpu_combo.itemData(index)
        if data == CUSTOM_GPU:
            text, ok = QtWidgets.QInputDialog.getText(
                self, "Custom GPU", "Memory per GPU (for example 24GiB, 80GB or 12288MiB):")
            if ok and text.strip():
                try:
                    self.state.set_gpu(find_gpu(text.strip()))
                except SetupError as e:
                    self.errorRaised.emit(str(e))
            self._sync_gpu()
            return
        if isinstance(data, int) and 0 <= data < len(self._gpu_specs):
            self.state.set_gpu(self._gpu_specs[data])

    # ---- model ------------------------------------------------------------------------------------------------
    def _on_model_activated(self, index: int) -> None:
        ref = self.model_combo.itemData(index)
        if isinstance(ref, str):
            self._use_model(ref.removeprefix("hub:"))

    def _on_model_text(self, text: str) -> None:
        text = text.strip()
        i = self.model_combo.findText(text, QtCore.Qt.MatchFlag.MatchFixedString)
        ref = self.model_combo.itemData(i) if i >= 0 else text
        if isinstance(ref, str) and ref:
            self._use_model(ref.removeprefix("hub:"))

    def _use_model(self, ref: str) -> None:
        if ref == self.state.model.ref:
            self.sync()
            return
        if is_hub_id(ref):  # the box keeps showing the id while it is looked up
            self.hubLookupRequested.emit(ref.strip())
            return
        try:
            self.state.set_model(ref)
        except SetupError as e:
            self.errorRaised.emit(str(e))
            self.sync()

    def show_lookup(self, text: str | None) -> None:
        """The lookup row under the model box: ``text`` says what is being fetched; ``None`` hides it."""
        self.lookup_row.setVisible(text is not None)
        self.lookup_label.setText(text or "")

    def set_hub_ids(self, cached: Iterable[str], recent: Iterable[str]) -> None:
        """Offer the Hub ids in the local cache and the recently used ones (after the imported models)."""
        for ref in self._hub_items:
            i = self.model_combo.findData(f"hub:{ref}")
            if i >= 0:
                self.model_combo.removeItem(i)
        cached = list(dict.fromkeys(cached))
        wanted = list(dict.fromkeys([*recent, *cached]))
        self._hub_items = wanted
        at = len(self._imported)
        for ref in wanted:
            where = "Hub, in the local cache" if ref in cached else "Hub, recently used"
            self.model_combo.insertItem(at, f"{ref}  ·  {where}", f"hub:{ref}")
            self.model_combo.setItemData(at, f"{ref}: {where}", QtCore.Qt.ItemDataRole.ToolTipRole)
            at += 1

    def remember_import(self, choice: ModelChoice) -> None:
        """Add an imported model to the list so it can be picked again."""
        if any(c.ref == choice.ref for c in self._imported):
            return
        self._imported.append(choice)
        self.model_combo.insertItem(0, f"{choice.spec.name}  ·  {fmt_count(choice.spec.param_count)} (imported)",
                                    choice.ref)
        self.model_combo.setItemData(0, choice.ref, QtCore.Qt.ItemDataRole.ToolTipRole)

    # ---- presets and targets -------------------------------------------------------------------------------------
    def _on_preset(self, _index: int) -> None:
        if self._syncing:
            return
        pid = self.preset_combo.currentData()
        if pid:
            self.state.apply_preset(pid)

    def _on_targets(self, _checked: bool) -> None:
        if self._syncing:
            return
        self.state.set_field("lora_targets", tuple(n for n, b in self.target_boxes.items()
                                                   if b.isChecked() and b.isEnabled()))

    def _set_targets(self, names: Sequence[str]) -> None:
        self.state.set_field("lora_targets", tuple(names))

    # ---- state -> controls ------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Show the state's fields in the controls (signals blocked: this never writes back)."""
        self._syncing = True
        try:
            self._sync_fields()
        finally:
            self._syncing = False

    def _sync_fields(self) -> None:
        st = self.state
        f = st.fields
        spec = st.model.spec
        if st.model.imported:
            self.remember_import(st.model)
        with QtCore.QSignalBlocker(self.model_combo):
            i = self.model_combo.findData(st.model.ref)
            if i >= 0:
                self.model_combo.setCurrentIndex(i)
            else:
                self.model_combo.setEditText(spec.name)
        info = f"{fmt_count(spec.param_count)} parameters · {spec.summary()}"
        if st.model.imported:
            info += f"\nFrom {st.model.origin}" if st.model.origin else f"\nImported from {st.model.ref}"
        self.model_info.setText(info)
        self.model_info.setToolTip(spec.source or spec.notes or "")

        for name, w in self._controls.items():
            value = f.get(name)
            if name in KERNEL_SETS:  # a set as the CLI writes it ("all", "lora_mlp,rms_norm"): shown as the setup's
                try:
                    value = KERNEL_SETS[name](value)
                except SetupError:
                    pass
            with QtCore.QSignalBlocker(w):
                if isinstance(w, QtWidgets.QComboBox):
                    select_data(w, value)
                elif isinstance(w, QtWidgets.QCheckBox):
                    w.setChecked(bool(value))
                elif isinstance(w, QtWidgets.QDoubleSpinBox):
                    target = 0.0 if value is None else float(value)
                    if w.value() != target:  # never rewrite the text the user is typing in
                        w.setValue(target)
                elif isinstance(w, QtWidgets.QSpinBox):
                    if name == "trainable_layers":
                        w.setMaximum(spec.num_layers)
                    if value is not None and w.value() != int(value):
                        w.setValue(int(value))
        targets = set(f.get("lora_targets") or ())
        present = {s.name for s in spec.layer_linears()} | {"lm_head"}
        adapted = set(spec.lora_modules(targets))  # separate q/k/v names adapt a fused qkv_proj
        for name, box in self.target_boxes.items():
            with QtCore.QSignalBlocker(box):
                box.setChecked(name in adapted)
                box.setEnabled(name in present)
                box.setToolTip(f"{name}: {TIPS['lora_targets']}" if name in present
                               else f"{spec.name} has no {name} module")

        method = Method(f["method"])
        uses_lora = method in (Method.LORA, Method.QLORA)
        self.lora_box.setEnabled(uses_lora)
        self.control("adapter_dtype").setEnabled(uses_lora)
        self.control("trainable_layers").setEnabled(method is Method.FREEZE)
        weights = f.get("weights")
        double_quant = self.control("double_quant")
        assert isinstance(double_quant, QtWidgets.QCheckBox)
        nf4 = weights == DType.NF4
        double_quant.setEnabled(nf4)
        if not nf4:  # the field keeps QLoRA's default for a later switch to NF4; unticked, it does not apply here
            with QtCore.QSignalBlocker(double_quant):
                double_quant.setChecked(False)
        stored = getattr(weights, "value", weights) or "these"
        double_quant.setToolTip(TIPS["double_quant"] if nf4 else
                                f"Applies to NF4 weights only: {stored} weights have no quantization scales "
                                "(QLoRA's default, on again when the weights are NF4).")
        optimizer = Optimizer(f["optimizer"])
        impl = self.control("optimizer_impl")
        assert isinstance(impl, QtWidgets.QComboBox)
        impl.setEnabled(optimizer.has_impl_choice)
        impl.setToolTip(TIPS["optimizer_impl"] if optimizer.has_impl_choice
                        else "8-bit optimizers have no foreach / fused choice: a profile runs bitsandbytes' own "
                             "kernels where bitsandbytes is installed (on CUDA), else an emulation, and says which.")
        self.control("loss_chunks").setEnabled(bool(f.get("chunked_loss")))
        self.control("vision_ckpt").setEnabled(bool(f.get("grad_ckpt")))  # nothing to checkpoint without it
        master = self.control("master_weights")
        zero = str(f.get("sharding")) in ("zero1", "zero2", "zero3")  # DeepSpeed's ZeRO optimizer keeps them
        assert isinstance(master, QtWidgets.QCheckBox)
        master.setEnabled(not zero)
        if zero:
            master.setChecked(True)
        master.setToolTip(TIPS["master_weights"] + ("\n\nAlways on under DeepSpeed ZeRO: its optimizer keeps fp32 "
                                                    "master partitions of 16-bit trainable weights." if zero else ""))
        for name in ("ckpt_offload", "unsloth_gc"):
            self.control(name).setEnabled(bool(f.get("grad_ckpt")))
        kernel = self.control("loss_kernel")
        assert isinstance(kernel, QtWidgets.QComboBox)
        kernel.setToolTip(f"{TIPS['loss_kernel']}\n\n{kernel.currentText()}: "
                          f"{kernel.itemData(kernel.currentIndex(), QtCore.Qt.ItemDataRole.ToolTipRole) or ''}")

        preset = st.current_preset()
        with QtCore.QSignalBlocker(self.preset_combo):
            select_data(self.preset_combo, preset.id if preset else None)
        self.preset_info.setText(preset.description if preset else
                                 "Custom: the settings below differ from every preset.")
        self._sync_gpu()
        self._sync_unsloth_free()
        self._sync_objective()
        self._sync_derived()
        self._sync_vision()

    # ---- objective (issue 15) -----------------------------------------------------------------------------------
    def _sync_derived(self) -> None:
        setup = self.state.current_setup()
        if setup is None:
            self.facts.setText("Derived: — (the setup is invalid; see the message above the chart)")
            self.effective.setText("—")
            return
        r = setup.resolved()
        self.facts.setText(
            f"Derived: {r['precision']} · gradients {r['grad_dtype']} · optimizer states "
            f"{r['optimizer_state_dtype']} · fp32 master copy {'yes' if r['fp32_master_copy'] else 'no'} · "
            f"autocast {'on' if r['amp'] else 'off'}"
        )
        n = setup.effective_batch
        self.effective.setText(f"{n:,} sequence{'' if n == 1 else 's'} per step "
                               f"({setup.micro_batch} × {setup.grad_accum} × {setup.gpus} GPU"
                               f"{'s' if setup.gpus > 1 else ''})")

    def _on_computed(self, _snapshot: object) -> None:
        self._sync_derived()

