"""tools/sgl_vtoken_tools/cli/mutation_check.py stays runnable as the runtime changes: each mutation's text occurs
exactly once in its runtime file, changes it, and a mutated file is put back as it was."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def mc(command):
    return command("mutation_check")


def test_every_mutation_names_one_place_of_the_runtime(mc):
    for name, (file, old, new, meaning) in mc.MUTATIONS.items():
        assert file.startswith("sgl_vtoken/"), name  # the runtime, never the oracles
        assert (REPO / file).read_text().count(old) == 1, name
        assert old != new and meaning, name


def test_mutate_replaces_once_and_refuses_an_ambiguous_text(mc, tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a < b\nc < d\n")
    assert mc.mutate(f, "a < b", "a <= b") == "a < b\nc < d\n"
    assert f.read_text() == "a <= b\nc < d\n"
    with pytest.raises(SystemExit, match="occurs 2 times"):
        mc.mutate(f, "<", ">")
