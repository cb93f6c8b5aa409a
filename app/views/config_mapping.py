"""Which setting came from which key: the mapping of the training config(s) the user opened.

A display of :class:`~vramlab.core.sources.mapping.SetupSource` (the view computes nothing): one line per
key, with the value in the file, the setting it gave, and whether it was the file's value, the framework's
default (with the version followed), or a key that changes memory but is not modelled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramlab.app.qt import QtCore, QtWidgets
from vramlab.app.views.text_table import Cell, TextTable

COLUMNS = ("Key", "In the file", "Setting", "How")


def _show(v: Any) -> str:
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


class ConfigMappingView(QtWidgets.QWidget):
    """The mapping table and a line naming the files and the defaults followed."""

    def __init__(self, parent: QtWidgets.QWidget | None = None) -> None:
        super().__init__(parent)
        col = QtWidgets.QVBoxLayout(self)
        col.setContentsMargins(6, 6, 6, 6)
        self.header = QtWidgets.QLabel("Open a training config (File → Open training config…, or drop it on "
                                       "the window) to see which setting comes from which key.")
        self.header.setObjectName("Facts")
        self.header.setWordWrap(True)
        self.header.setTextInteractionFlags(QtCore.Qt.TextInteractionFlag.TextSelectableByMouse)
        col.addWidget(self.header)
        self.table = TextTable(COLUMNS, self)
        self.table.setObjectName("ConfigMapping")
        self.table.setSelectionBehavior(QtWidgets.QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 8)  # dense: many keys
        head = self.table.horizontalHeader()
        for i in range(len(COLUMNS) - 1):
            head.setSectionResizeMode(i, QtWidgets.QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(len(COLUMNS) - 1, QtWidgets.QHeaderView.ResizeMode.Stretch)
        col.addWidget(self.table, 1)
        self.source: Any = None
        self._groups: list[list[Any]] = []
        self._base_how: list[str] = []  # each row's last column as read, before the window's edits

    def set_source(self, source: Any) -> None:
        """Show a SetupSource (``None`` clears the view)."""
        from vramlab.core.sources.mapping import DEFAULT, FRAMEWORKS, NOT_MODELLED, REFUSED, grouped_rows

        self.source = source
        self._groups = []
        self._base_how = []
        if source is None:
            self.table.set_rows([])
            return
        files = "; ".join(f"{Path(f).name}: {FRAMEWORKS[fw][0]} (defaults of {FRAMEWORKS[fw][1]})"
                          for f, fw in source.frameworks)
        model = f" Model: {source.model}." if source.model else ""
        self.header.setText(f"{files}.{model}")
        rows = []
        for group in grouped_rows(source.rows):  # one key that sets several fields is one line
            r = group[0]
            self._groups.append(group)
            if r.status == NOT_MODELLED:
                setting, how = "—", "not modelled" + (f": {r.note}" if r.note else "")
            elif r.field is None:
                setting, how = "—", r.note
            else:
                setting = ", ".join(f"{g.field} = {_show(g.setting)}" for g in group)
                how = {DEFAULT: "framework default", REFUSED: "cannot be modelled"}.get(r.status, "from the file")
                if r.note:
                    how += f" ({r.note})"
                over = [g.overridden_by for g in group if g.overridden_by]
                if over:
                    how += f"; overridden by {', '.join(over)}"
            value = "(absent)" if r.status == DEFAULT else _show(r.value)
            cells = (r.key, value, setting, how)
            tip = f"{r.file}\n{r.key}: {value}\n{how}"
            dim = r.status in (DEFAULT, NOT_MODELLED) or all(g.overridden_by for g in group)
            rows.append([Cell(text, tooltip=tip, muted=dim) for text in cells])
            self._base_how.append(how)
        self.table.set_rows(rows)

    def mark_edits(self, fields: dict[str, Any]) -> None:
        """Say, in the last column, which settings were changed in the window since the config was read."""
        from vramlab.core.sources.mapping import NOT_MODELLED

        for row, (group, base) in enumerate(zip(self._groups, self._base_how)):
            if group[0].status == NOT_MODELLED or group[0].field is None:
                continue
            live = [g for g in group if not g.overridden_by and g.field in fields]
            edited = [f"{g.field} = {_show(fields[g.field])}" for g in live if fields[g.field] != g.setting]
            self.table.set_text(row, len(COLUMNS) - 1,
                                base + (f"; changed in the window: {', '.join(edited)}" if edited else ""))
