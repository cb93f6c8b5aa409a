"""README.md is the product page: every figure and example in it is the program's, so it cannot go stale.

The example outputs are run and compared (tools/readme_examples.py, which also rewrites them); the preset and
GPU counts come from the catalogue; the package sizes from the recorded build (benchmarks/results/build.json);
the system packages for the window from the libraries PySide6's xcb plugin really links; every subcommand of
the CLI has its row; no commit hash, load average or before/after history; every relative link resolves.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from vramlab.core.catalog import gpus, models

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _load(path: Path, name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


examples_tool = _load(ROOT / "tools" / "readme_examples.py", "readme_examples")
# app/platform_check.py imports no Qt: it is read here as a file (the core session blocks PySide6's import)
platform_check = _load(ROOT / "app" / "platform_check.py", "readme_platform_check")


def test_readme_has_examples_and_each_shows_what_the_command_prints() -> None:
    found = examples_tool.examples(README)
    assert found, "the README shows no example output"
    for ex in found:
        real = examples_tool.run(ex.command)
        assert examples_tool.matches(ex.shown, real), (
            f"README's output of '{ex.command}' differs from the program's (python tools/readme_examples.py "
            "--write rewrites it):\n" + "\n".join(real))


def test_an_elided_example_still_fails_on_a_changed_line() -> None:
    real = ["title", "a 1", "b 2", "c 3", "tail"]
    assert examples_tool.matches(["title", "a 1", "..."], real)
    assert examples_tool.matches(["title", "...", "c 3", "..."], real)
    assert not examples_tool.matches(["title", "a 9", "..."], real)
    assert not examples_tool.matches(["title", "...", "c 4", "..."], real)
    assert not examples_tool.matches(["title", "a 1"], real)


def test_the_preset_and_gpu_counts_are_the_catalogues() -> None:
    assert int(re.search(r"\((\d+) model presets\)", README)[1]) == len(models())
    assert int(re.search(r"\((\d+) GPUs\)", README)[1]) == len(gpus())


def test_every_cli_command_has_a_row_in_the_question_table() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys; from vramlab.app.entry import main; "
                          "sys.exit(main(['--help']))"], capture_output=True, text=True, check=True).stdout
    commands = re.search(r"\{([a-z,-]+)\}", out)[1].split(",")
    table = README.split("## Which command answers which question", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`vramlab " in line]
    for command in commands:
        assert any(f"`vramlab {command}" in row for row in rows), f"no row for `vramlab {command}`"


def test_package_sizes_are_the_recorded_builds() -> None:
    build = json.loads((ROOT / "benchmarks" / "results" / "build.json").read_text())["variants"]
    table = README.split("<!-- sizes: benchmarks/results/build.json -->", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in table.splitlines()[2:]}
    for name, variant, kind in [("`vramlab_<version>_amd64.deb`", "full", "deb"),
                                ("`vramlab-estimator_<version>_amd64.deb`", "estimator", "deb"),
                                ("`vramlab-<version>-linux-x86_64-full.tar.gz`", "full", "tar.gz"),
                                ("`vramlab-<version>-linux-x86_64-estimator.tar.gz`", "estimator", "tar.gz")]:
        assert rows[name] == f"{round(build[variant]['packages'][kind]['mib'])} MiB", name
    for variant, words in [("full", "the full app takes"), ("estimator", "the estimator-only one")]:
        shown = re.search(words + r" (\d+) MiB", README)
        assert shown and int(shown[1]) == round(build[variant]["folder_mib"]), variant


def _install_lines() -> dict[str, list[str]]:
    """The package names of each distribution's install command (continued over lines ending in a backslash)."""
    commands = re.sub(r"\\\n\s*", " ", README).splitlines()
    lines = {}
    for prefix, distro in [("sudo apt install ", "Debian/Ubuntu"), ("sudo dnf install ", "Fedora"),
                           ("sudo pacman -S ", "Arch")]:
        line = next(x for x in commands if x.startswith(prefix))
        lines[distro] = line[len(prefix):].split("#")[0].split()
    return lines


def test_the_system_package_lines_hold_every_library_the_xcb_plugin_links() -> None:
    plugins = Path(sysconfig.get_paths()["purelib"]) / "PySide6" / "Qt" / "plugins" / "platforms"
    if not (plugins / "libqxcb.so").is_file():
        pytest.skip("PySide6's xcb plugin is not installed here (Linux only)")
    libs = set(platform_check.needed(plugins / "libqxcb.so"))
    libs |= set(platform_check.needed(plugins.parents[1] / "lib" / "libQt6XcbQpa.so.6"))
    libs = {x for x in libs if not x.startswith(("libQt6", "libc.", "libm.", "libstdc++", "libgcc_s"))}
    unknown = libs - set(platform_check.PACKAGES)
    assert not unknown, f"app/platform_check.py does not know the packages of {sorted(unknown)}"
    lines = _install_lines()
    for i, (distro, _) in enumerate(platform_check.INSTALLERS):
        wanted = {platform_check.PACKAGES[x][i] for x in libs}
        assert wanted <= set(lines[distro]), f"{distro}: the README misses {sorted(wanted - set(lines[distro]))}"


def test_no_commit_hashes_load_averages_or_history() -> None:
    text = README.lower()
    assert "load average" not in text
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not hashes, hashes
    assert " before the " not in text and "in the same run" not in text


def test_relative_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_the_test_command_is_what_ci_runs() -> None:
    assert "make test" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make lint$", ci, re.M) and re.search(r"^make test$", ci, re.M)


def test_no_file_cites_documents_outside_the_repository() -> None:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"], capture_output=True,
                            text=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    outside = re.compile(r"\b(DESIGN|STYLE)\.md\b|\.\./shared/")
    me = Path(__file__).resolve()
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if path.resolve() == me or path.suffix not in (".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".iss", ".spec"):
            continue
        if path.is_file():
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                assert not outside.search(line), f"{name}:{n} cites a file outside the repository: {line.strip()}"
