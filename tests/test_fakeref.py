"""FakeTensorMode's answers kept on disk for the fast simulation (core/simulation/fakeref.py): exact round trips,
a file that is damaged, foreign or from another torch build read as a miss, bounded, merged, never code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vramlab.core.simulation import fakeref
from vramlab.core.simulation.fakeref import MISSING, FakeReferences, Ref

LAYOUT = (tuple, (((1, 32, 512, 128), (2097152, 128, 4096, 1), torch.bfloat16, 0, 4194304, None),
                  ((1, 32, 512), (16384, 1, 32), torch.float32, 0, 65536, -2)))
PROGRAM = (((torch.ops.prim.device.default, (Ref(1),), {}, ()),
            (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (Ref(0), Ref(1), Ref(2), 0.0, True),
             {"scale": 0.08838834764831845}, (4,)),
            (torch.ops.aten.detach.default, (Ref(3),), {}, ())), Ref(3))
KEY = ("op", "torch.float32", "aten.mul.Tensor", ((torch.Size([3]), (1,), 0, torch.float32), (int, 2)))


def test_what_is_saved_comes_back_equal_in_another_process(tmp_path: Path) -> None:
    store = FakeReferences(tmp_path)
    values = {KEY: LAYOUT, ("sdpa", 1): PROGRAM, ("op", 2): None, ("in place", 3): True,
              ("list", 4): (list, [((2, 2), (2, 1), torch.int64), None]), ("enums", 5): (torch.strided,
                                                                                     torch.contiguous_format)}
    for key, value in values.items():
        store.put(key, value)
    store.save()
    later = FakeReferences(tmp_path)
    for key, value in values.items():
        got = later.get(key)
        assert got == value
        assert repr(got) == repr(value)  # tuples stay tuples, ints ints, the same op objects
    assert later.get(("op", 6)) is MISSING
    assert later.hits == len(values) and later.misses == 1


def test_a_value_without_an_exact_form_stays_in_memory_only(tmp_path: Path) -> None:
    store = FakeReferences(tmp_path)
    store.put(("a",), float("nan"))
    store.put(("b",), torch.empty(1))
    store.save()
    assert not (tmp_path / fakeref.FILE_NAME).exists()
    assert FakeReferences(tmp_path).get(("a",)) is MISSING


def lines(header: dict, entries: dict[str, object]) -> str:
    """The file as fakeref writes it: a JSON header, then the digest and the JSON of each answer."""
    return json.dumps(header) + "\n" + "".join(f"{name} {json.dumps(v)}\n" for name, v in entries.items())


def kept(path: Path) -> list[str]:
    return [line.split(" ")[0] for line in path.read_text().splitlines()[1:]]


FOREIGN = lines({"format": fakeref.FORMAT, "torch": "1.0.0 other"}, {fakeref.digest(KEY): {"t": []}}).encode()


@pytest.mark.parametrize("text", [
    b"\x00\xff not json",
    FOREIGN,  # another torch build's answers, under the same key
    b"[" * 100_000,  # nested past the parser's recursion
    b'{"format": 999}\n',
    b'{"format": 1, "torch": null}\n',
    b"",
    "\u00e9".encode("latin-1"),  # not UTF-8
], ids=["binary", "other torch build", "deeply nested", "other format", "wrong types", "empty", "not utf-8"])
def test_a_damaged_or_foreign_file_is_a_miss_and_is_replaced(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / fakeref.FILE_NAME
    path.write_bytes(text)
    store = FakeReferences(tmp_path)
    assert store.get(KEY) is MISSING
    store.put(KEY, LAYOUT)
    store.save()
    assert FakeReferences(tmp_path).get(KEY) == LAYOUT
    assert json.loads(path.read_text().splitlines()[0])["torch"] == fakeref.torch_build()


@pytest.mark.parametrize("entry", [
    {"op": ["builtins", "eval", "default"]},  # only torch.ops.aten and torch.ops.prim are looked up
    {"op": ["aten", "no_such_op_anywhere", "default"]},
    {"dtype": "Tensor"},  # torch.Tensor is not a dtype
    {"dtype": "__import__"},
    {"t": [1], "d": {}},
    {"what": 1},
    {"ref": "0"},
], ids=["another namespace", "no such op", "not a dtype", "a function", "two tags", "unknown tag", "ref not int"])
def test_an_entry_we_never_write_is_a_miss_never_code(tmp_path: Path, entry: dict) -> None:
    (tmp_path / fakeref.FILE_NAME).write_text(lines({"format": fakeref.FORMAT, "torch": fakeref.torch_build()},
                                                    {fakeref.digest(KEY): entry}))
    assert FakeReferences(tmp_path).get(KEY) is MISSING


def test_a_damaged_line_costs_only_its_own_answer(tmp_path: Path) -> None:
    other = ("op", "other")
    text = lines({"format": fakeref.FORMAT, "torch": fakeref.torch_build()},
                 {fakeref.digest(KEY): fakeref.encode(LAYOUT), fakeref.digest(other): {"t": [1]}})
    path = tmp_path / fakeref.FILE_NAME
    path.write_text(text.replace('{"t": [1]}', '{"t": [1') + "half a line\n\x00\n")  # a torn line, then noise
    store = FakeReferences(tmp_path)
    assert store.get(KEY) == LAYOUT
    assert store.get(other) is MISSING


def test_the_file_is_bounded_oldest_first_and_merges_what_another_process_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fakeref, "MAX_ENTRIES", 3)
    first, second = FakeReferences(tmp_path), FakeReferences(tmp_path)
    assert first.get(("k", 0)) is MISSING and second.get(("k", 0)) is MISSING  # both have read the file
    first.put(("k", 1), 1)
    first.save()
    second.put(("k", 2), 2)
    second.save()  # merged with the first's answer, not over it
    again = FakeReferences(tmp_path)
    assert (again.get(("k", 1)), again.get(("k", 2))) == (1, 2)
    for i in range(3, 6):
        again.put(("k", i), i)
    again.save()
    last = FakeReferences(tmp_path)
    assert [last.get(("k", i)) for i in range(1, 6)] == [MISSING, MISSING, 3, 4, 5]
    monkeypatch.setattr(fakeref, "MAX_BYTES", 600)  # the newest that fit in the byte bound
    last.put(("big",), list(range(60)))
    last.save()
    path = tmp_path / fakeref.FILE_NAME
    assert path.stat().st_size <= 600
    assert fakeref.digest(("k", 3)) not in kept(path) and kept(path)[-1] == fakeref.digest(("big",))


def test_a_disk_that_refuses_the_write_keeps_the_answers_in_memory(tmp_path: Path) -> None:
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    store = FakeReferences(blocked / "cache")
    store.put(KEY, LAYOUT)
    store.save()  # no exception
    assert store.get(KEY) == LAYOUT


def test_the_file_lives_in_the_cache_folder_the_user_chose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMLAB_CACHE_DIR", str(tmp_path / "chosen"))
    store = FakeReferences()
    store.put(KEY, LAYOUT)
    store.save()
    assert (tmp_path / "chosen" / fakeref.FILE_NAME).is_file()
    assert not list(tmp_path.glob("chosen/.*.tmp"))  # written to a temporary file and renamed


def test_without_a_home_folder_the_answers_stay_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRAMLAB_CACHE_DIR", raising=False)

    def nowhere() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(nowhere))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    store = FakeReferences()
    assert store.get(KEY) is MISSING
    store.put(KEY, LAYOUT)
    store.save()  # no exception
    assert store.get(KEY) == LAYOUT
