"""Exports: PNG at 2x, SVG that parses and holds the chart as vectors and text, CSV and Markdown tables that
match the screen, the clipboard, and the Ctrl+E dialog."""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET

import pytest

from vramlab.app.qt import QtGui, QtWidgets
from vramlab.app.views.report import REPORT_SIZE
from vramlab.core.estimate import estimate
from vramlab.core.units import GiB, fmt_bytes

SVG = "{http://www.w3.org/2000/svg}"


def svg_summary(path) -> tuple[int, str]:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    shapes = sum(1 for el in root.iter() if el.tag in (f"{SVG}path", f"{SVG}rect", f"{SVG}polyline"))
    text = " ".join(t for el in root.iter(f"{SVG}text") for t in el.itertext())
    return shapes, text


def test_chart_png_is_twice_the_widget_size(window, tmp_path):
    path = tmp_path / "chart.png"
    assert window.export_to(str(path), "chart-png")
    image = QtGui.QImage(str(path))
    area = window.breakdown.chart_area.size()
    assert (image.width(), image.height()) == (area.width() * 2, area.height() * 2)
    assert image.pixelColor(image.width() // 2, image.height() // 2).isValid()


def test_chart_svg_parses_and_holds_vectors_and_labels(window, tmp_path):
    path = tmp_path / "chart.svg"
    assert window.export_to(str(path), "chart-svg")
    shapes, text = svg_summary(path)
    assert shapes > 20
    snap = window.state.flush()
    for row in snap.rows:
        assert fmt_bytes(row.result.peak_allocated_bytes) in text  # the value labels, as text
    assert "Current setup" in text and "Weights" in text  # ticks and legend
    assert "<image" not in path.read_text()  # no raster fallback


def test_report_png_and_svg(window, tmp_path):
    png, svg = tmp_path / "report.png", tmp_path / "report.svg"
    assert window.export_to(str(png), "report-png")
    image = QtGui.QImage(str(png))
    assert (image.width(), image.height()) == (REPORT_SIZE.width() * 2, REPORT_SIZE.height() * 2)
    corner = image.pixelColor(5, 5)
    assert (corner.red(), corner.green(), corner.blue()) == (255, 255, 255)  # light, whatever the app theme
    assert window.export_to(str(svg), "report-svg")
    shapes, text = svg_summary(svg)
    assert shapes > 20
    assert "GPU memory of fine-tuning Llama-2-7B" in text
    assert "LoRA r8" in text  # the setup summary


def test_report_is_light_in_the_dark_theme(window, tmp_path):
    window.apply_theme_mode("dark", save=False)
    path = tmp_path / "report.png"
    assert window.export_to(str(path), "report-png")
    image = QtGui.QImage(str(path))
    plot = window.report.chart.plot
    centre = plot.mapTo(window.report, plot.rect().center())
    pixel = image.pixelColor(centre.x() * 2 + 3, 40 * 2)
    assert pixel.lightness() > 200
    assert window.report.chart.plot.backgroundBrush().color().lightness() > 200
    chart = tmp_path / "chart.png"
    window.export_to(str(chart), "chart-png")  # the chart export keeps the app's (dark) theme
    img = QtGui.QImage(str(chart))
    assert img.pixelColor(4, img.height() // 2).lightness() < 80


def test_table_csv_rows_match_the_core(window, tmp_path):
    path = tmp_path / "table.csv"
    assert window.export_to(str(path), "table-csv")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    snap = window.state.flush()
    assert len(body) == len(snap.rows)
    col = header.index("Tensors [GiB]")
    weights = header.index("Weights [GiB]")
    for line, row in zip(body, snap.rows):
        core = estimate(row.model, row.setup, snap.gpu)
        assert line[0] == row.name
        assert float(line[col]) == pytest.approx(core.peak_allocated_bytes / GiB, abs=5e-4)
        assert float(line[weights]) == pytest.approx(core.components[next(iter(core.components))] / GiB, abs=5e-4)


def test_table_markdown(window, tmp_path):
    path = tmp_path / "table.md"
    assert window.export_to(str(path), "table-md")
    lines = path.read_text(encoding="utf-8").splitlines()
    table = [line for line in lines if line.startswith("|")]
    snap = window.state.flush()
    assert len(table) == 2 + len(snap.rows)
    assert table[0].startswith("| Scenario | Model |") and "Tensors [GiB]" in table[0]
    assert set(table[1]) <= set("|-: ")
    assert table[2].startswith("| Current setup | Llama-2-7B |")
    assert fmt_bytes(snap.rows[1].result.peak_allocated_bytes, suffix=False) in table[3]
    assert any("per gpu" in line.lower() for line in lines)


def test_clipboard(window):
    clipboard = QtWidgets.QApplication.clipboard()
    window.copy_chart()
    assert not clipboard.image().isNull()
    assert clipboard.image().width() == window.breakdown.chart_area.width() * 2
    window.copy_table()
    assert clipboard.text().startswith("| Scenario |")
    assert bytes(clipboard.mimeData().data("text/csv")).decode().startswith("Scenario,Model")


def test_ctrl_e_uses_the_chosen_filter(window, tmp_path, monkeypatch):
    target = tmp_path / "picked"
    monkeypatch.setattr(QtWidgets.QFileDialog, "getSaveFileName",
                        lambda *a, **k: (str(target), "Chart, SVG (*.svg)"))
    window.act_export.trigger()
    assert (tmp_path / "picked.svg").exists()
    svg_summary(tmp_path / "picked.svg")


def test_export_to_an_unwritable_place_is_reported(window, tmp_path):
    assert not window.export_to(str(tmp_path / "missing" / "x.csv"), "table-csv")
    assert window.message_banner.isVisible() and "x.csv" in window.message_banner.text()


@pytest.mark.parametrize("tab", ["phases", "advisor", "live"])
def test_chart_export_follows_the_tab_on_show(window, tmp_path, tab):
    """On the Phases, Advisor and Live tabs, 'chart' means their own chart, at 2x, in PNG and in SVG."""
    view = getattr(window, tab)
    window.tabs.setCurrentWidget(view)
    widget, what = window.current_chart()
    assert widget is {"phases": lambda: view.chart_area, "advisor": lambda: view.chart.chart_area,
                      "live": lambda: view.plots}[tab]()
    png, svg = tmp_path / f"{tab}.png", tmp_path / f"{tab}.svg"
    assert window.export_to(str(png), "chart-png") and window.export_to(str(svg), "chart-svg")
    image = QtGui.QImage(str(png))
    assert (image.width(), image.height()) == (widget.width() * 2, widget.height() * 2)
    assert svg_summary(svg)[0] > 0 and what in window.statusBar().currentMessage()
