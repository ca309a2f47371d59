from pathlib import Path

import pytest

from llmhost.backend.kept_counts import STATE_DIR_ENV, add_count, count_file, read_count


def test_no_state_folder_keeps_nothing():
    assert count_file("engine_hangs", "tiny", "tiny_0_0", environ={}) is None
    assert count_file("engine_hangs", "tiny", "tiny_0_0", environ={STATE_DIR_ENV: "  "}) is None
    assert read_count(None) == 0
    assert add_count(None) == 1


def test_counts_add_up_per_instance_and_survive_a_new_reader(tmp_path: Path):
    env = {STATE_DIR_ENV: str(tmp_path)}
    first = count_file("engine_hangs", "tiny", "tiny_0_0", environ=env)
    other = count_file("engine_hangs", "tiny", "tiny_0_1", environ=env)
    assert first == tmp_path / "tiny" / "tiny_0_0.engine_hangs"
    assert read_count(first) == 0
    assert add_count(first) == 1
    assert add_count(first) == 2
    assert add_count(other, by=3) == 3
    assert (read_count(first), read_count(other)) == (2, 3)
    assert first is not None and first.read_text() == "2\n"
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["tiny_0_0.engine_hangs", "tiny_0_1.engine_hangs"]


def test_names_cannot_leave_the_state_folder(tmp_path: Path):
    env = {STATE_DIR_ENV: str(tmp_path)}
    assert count_file("engine_hangs", "../../etc", "a/b", environ=env) == tmp_path / "_._.._etc" / "a_b.engine_hangs"
    assert count_file("engine_hangs", "..", ".", environ=env) == tmp_path / "_." / "_.engine_hangs"


@pytest.mark.parametrize("text", ["", "x", "-1", "1.5", "\xff"])
def test_a_damaged_count_starts_from_zero(tmp_path: Path, text: str):
    path = tmp_path / "tiny" / "tiny_0_0.engine_hangs"
    path.parent.mkdir()
    path.write_bytes(text.encode("latin-1"))
    assert read_count(path) == 0
    assert add_count(path) == 1


def test_an_unwritable_state_folder_raises_oserror(tmp_path: Path):
    (tmp_path / "tiny").write_text("a file where the model's folder goes")
    with pytest.raises(OSError):
        add_count(tmp_path / "tiny" / "tiny_0_0.engine_hangs")
