"""How scripts/mutants.py anchors a mutant, on small files written here (not the tree, so the CI selection that
plants the catalogue's bugs can hold this file): a pattern is matched in its function ignoring whitespace and
comments, a line pattern takes its line's comment, an edit is re-indented level by level, a moved function is
found, and an old-format entry is anchored in its innermost function, telling apart texts that only their
indentation told apart. Also the order conftest.py gives the suite (the smoke tier, then the heaviest tests), which
the catalogue's runs keep after each mutant's own first tests."""
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "mutants.py"
_spec = importlib.util.spec_from_file_location("mutants", _PATH)
mutants = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutants", mutants)     # dataclasses look their module up by name
_spec.loader.exec_module(mutants)
Mutant = mutants.Mutant

POOL = """\
import math


class Pool:
    def free(self, seq):
        for page_id in reversed(seq.table):  # tail first
            page = self.pages[page_id]
            if page.refs < 1:
                raise ValueError(page_id)
            page.refs -= 1
        seq.table = []

    def take(self, seq):
        if seq.table:
            page = self.pages[seq.table[-1]]
        return page


def area(r):
    return math.pi * r * r
"""

# POOL reformatted: indentation doubled, a call re-wrapped, a comment and blank lines added, an unrelated
# function renamed.
POOL_REFORMATTED = """\
import math


class Pool:
        def free(self, seq):

                for page_id in reversed(  # the last page first
                        seq.table):
                        page = self.pages[page_id]

                        if page.refs < 1:
                                raise ValueError(page_id)
                        page.refs -= 1
                seq.table = []

        def take(self, seq):
                if seq.table:
                        page = self.pages[seq.table[-1]]
                return page


def circle_area(r):
    return math.pi * r * r
"""

LOOP = "        for page_id in reversed(seq.table):\n            page = self.pages[page_id]\n"
CHECK = "            if page.refs < 1:\n                raise ValueError(page_id)\n            page.refs -= 1\n"


def _tree(tmp_path: Path, **files: str) -> "mutants.Sources":
    for name, text in files.items():
        (tmp_path / "chunkwise").mkdir(exist_ok=True)
        (tmp_path / "chunkwise" / f"{name}.py").write_text(text)
    return mutants.Sources(tmp_path)


def _plant(tmp_path, m, **files) -> str:
    return mutants.resolve(m, _tree(tmp_path, **files)).mutated


def test_a_line_pattern_replaces_its_whole_line_comment_included(tmp_path):
    m = Mutant("head_first", "chunkwise/pool.py::Pool.free", "        for page_id in reversed(seq.table):\n",
               "        for page_id in seq.table:\n", "frees head first")
    assert _plant(tmp_path, m, pool=POOL) == POOL.replace("reversed(seq.table):  # tail first", "seq.table:")


def test_a_pattern_is_found_whatever_the_whitespace_and_comments_around_its_code(tmp_path):
    m = Mutant("head_first", "chunkwise/pool.py::Pool.free", LOOP, LOOP.replace("reversed(seq.table)", "seq.table"),
               "frees head first")
    planted = _plant(tmp_path, m, pool=POOL_REFORMATTED)
    assert "                for page_id in seq.table:\n                        page = self.pages[page_id]\n\n" \
           in planted
    assert "reversed" not in planted


def test_an_edit_is_reindented_level_by_level(tmp_path):
    m = Mutant("refs_never_checked", "chunkwise/pool.py::Pool.free", CHECK,
               "            if False:\n                raise ValueError(page_id)\n"
               "            if page.refs:\n                    page.refs -= 1\n", "never checks refs")
    planted = _plant(tmp_path, m, pool=POOL_REFORMATTED)
    assert ("                        if False:\n                                raise ValueError(page_id)\n"
            "                        if page.refs:\n                                    page.refs -= 1\n") in planted
    compile(planted, "pool.py", "exec")


def test_the_pattern_is_looked_for_in_its_function_only(tmp_path):
    page = "            page = self.pages[seq.table[-1]]\n"
    m = Mutant("last_page_twice", "chunkwise/pool.py::Pool.take", page, page.replace("-1", "-2"), "takes the page")
    assert _plant(tmp_path, m, pool=POOL) == POOL.replace("seq.table[-1]", "seq.table[-2]")
    with pytest.raises(mutants.AnchorError, match="last_page_twice: Pool.free in chunkwise/pool.py no longer holds"):
        _plant(tmp_path, Mutant("last_page_twice", "chunkwise/pool.py::Pool.free", page, page, "-"), pool=POOL)


def test_a_moved_function_is_found_in_the_one_other_file_that_holds_it_and_its_pattern(tmp_path):
    m = Mutant("area_halved", "chunkwise/pool.py::area", "math.pi * r * r", "math.pi * r * r / 2", "halves it")
    shapes = "import math\n\n\ndef area(r):\n    return math.pi * r * r\n"
    sources = _tree(tmp_path, pool=POOL.replace("def area", "def circle_area"), shapes=shapes,
                    other="def area(r):\n    return r * r\n")
    r = mutants.resolve(m, sources)
    assert (r.path, r.moved, r.mutated) == ("chunkwise/shapes.py", True, shapes.replace("r * r", "r * r / 2"))
    assert mutants.moved([m], root=tmp_path) == [
        "area_halved: moved: update path chunkwise/pool.py -> chunkwise/shapes.py (`python scripts/mutants.py "
        "--anchor`)"]


def test_anchor_takes_the_innermost_function_and_drops_comments(tmp_path):
    sources = _tree(tmp_path, pool=POOL)
    m = mutants.anchor("head_first", "chunkwise/pool.py", "        for page_id in reversed(seq.table):  # tail first\n",
                       "        for page_id in seq.table:\n", "frees head first", sources)
    assert (m.where, m.old) == ("chunkwise/pool.py::Pool.free", "        for page_id in reversed(seq.table):\n")
    m = mutants.anchor("pi_rounded", "chunkwise/pool.py", "import math\n", "import math\nmath.pi = 3\n", "-", sources)
    assert m.where == "chunkwise/pool.py::<module>"


def test_anchor_tells_apart_texts_that_only_indentation_told_apart(tmp_path):
    twice = "def f(x):\n    if x:\n        return g(\n            x)\n    return g(\n        x)\n"
    sources = _tree(tmp_path, twice=twice)
    old, new = "        return g(\n            x)\n", "        return g(\n            -x)\n"
    m = mutants.anchor("negated", "chunkwise/twice.py", old, new, "-", sources)
    assert m.where == "chunkwise/twice.py::f" and m.old == "    if x:\n" + old
    assert mutants.resolve(m, sources).mutated == twice.replace(old, new)


def test_a_mutant_whose_file_is_gone_is_found_where_its_function_went_or_fails_by_name(tmp_path):
    m = Mutant("area_halved", "chunkwise/geometry.py::area", "math.pi * r * r", "math.pi * r * r / 2", "halves it")
    sources = _tree(tmp_path, shapes="import math\n\n\ndef area(r):\n    return math.pi * r * r\n")
    assert mutants.resolve(m, sources).path == "chunkwise/shapes.py"
    gone = Mutant("gone", "chunkwise/geometry.py::volume", "r * r * r", "r * r", "-")
    assert mutants.validate([gone], root=tmp_path) == ["gone: chunkwise/geometry.py does not exist"]


def test_a_file_that_is_not_python_is_one_span_whose_hashes_are_text(tmp_path):
    readme = "# Composing\n\n```python\ndoc_b = eng.register_chunk(b)  # the second\nprint(doc_b)\n```\n"
    (tmp_path / "README.md").write_text(readme)
    sources = mutants.Sources(tmp_path)
    m = mutants.anchor("renamed", "README.md", "doc_b = eng.register_chunk(b)  # the second\n",
                       "doc_2 = eng.register_chunk(b)  # the second\n", "-", sources)
    assert (m.where, m.old) == ("README.md::<module>", "doc_b = eng.register_chunk(b)  # the second\n")
    assert mutants.resolve(m, sources).mutated == readme.replace("doc_b = eng", "doc_2 = eng")
    heading = Mutant("heading", "README.md::<module>", "# Composing\n", "# Composition\n", "-")
    assert mutants.resolve(heading, sources).mutated == readme.replace("Composing", "Composition")


def _named_first(monkeypatch, names: str, first: str = ""):
    """The pinned stage's ordering plugin as pytest loads it (order_named_first's own source), with
    CHUNKWISE_MUTANT_NAMES and CHUNKWISE_MUTANT_FIRST set."""
    assert "def order_named_first(" in mutants.NAMED_FIRST_PLUGIN
    monkeypatch.setenv("CHUNKWISE_MUTANT_NAMES", names)
    monkeypatch.setenv("CHUNKWISE_MUTANT_FIRST", first)
    namespace: dict = {}
    exec(compile(mutants.NAMED_FIRST_PLUGIN, "_mutants_named_first.py", "exec"), namespace)
    return namespace["pytest_collection_modifyitems"]


class _Item:
    def __init__(self, function, nodeid=""):
        self.function, self.nodeid = function, nodeid or f"tests/t.py::{function.__name__}"


def _calls_tile_config():
    return "tile_config"       # the source names it


def _calls_other():
    return "tile_configs"      # a longer name: not a mention


def _calls_nothing():
    return None


def test_tests_naming_a_mutants_function_run_first_and_every_test_still_runs(monkeypatch):
    """order_named_first, as the plugin runs it."""
    order = _named_first(monkeypatch, "tile_config")
    items = [_Item(_calls_nothing), _Item(_calls_other), _Item(_calls_tile_config), _Item(len)]
    before = list(items)
    order(None, items)
    assert [i.function for i in items] == [_calls_tile_config, _calls_nothing, _calls_other, len]
    assert sorted(map(id, items)) == sorted(map(id, before))


def test_a_name_more_tests_mention_than_the_limit_moves_nothing(monkeypatch):
    """order_named_first, as the plugin runs it, on both sides of NAMED_FIRST_LIMIT."""
    order = _named_first(monkeypatch, "tile_config")
    at_limit = [_Item(_calls_nothing)] + [_Item(_calls_tile_config) for _ in range(mutants.NAMED_FIRST_LIMIT)]
    items = list(at_limit)
    order(None, items)
    assert items[0].function is _calls_tile_config                      # the limit's count still moves
    over = [_Item(_calls_nothing)] + [_Item(_calls_tile_config) for _ in range(mutants.NAMED_FIRST_LIMIT + 1)]
    items = list(over)
    order(None, items)
    assert items == over


def test_a_mutant_is_named_by_its_function_its_kernels_launcher_its_class_or_its_constants():
    def names(where, old="x = 1"):
        return mutants.named(Mutant("m", where, old, "x", "bug"))
    assert names("a.py::tile_config") == ["tile_config"]
    assert names("a.py::Pool.free") == ["free"]
    assert names("a.py::_rope_store_kernel") == ["_rope_store_kernel", "rope_store"]
    assert names("a.py::_AbortingStream.__call__") == ["_AbortingStream"]
    assert names("a.py::<module>", "WIDE_TILES = (MAX_BYTES, 8)") == ["MAX_BYTES", "WIDE_TILES"]


def test_the_test_that_killed_a_mutant_last_runs_first_then_the_named_ones(monkeypatch, tmp_path):
    """order_named_first with the recorded killer (CHUNKWISE_MUTANT_FIRST, node ids one a line), and record_kills
    keeping a killed mutant's first failing test for the next run beside the entries of mutants not run, and
    dropping the entries of names the catalogue no longer holds."""
    order = _named_first(monkeypatch, "tile_config", "tests/t.py::killer[a-1]\ntests/t.py::gone\ntests/t.py::base")
    other, named, killer, last = (_Item(_calls_other), _Item(_calls_tile_config),
                                  _Item(_calls_nothing, "tests/t.py::killer[a-1]"), _Item(len))
    case, near = _Item(_calls_nothing, "tests/t.py::base[x y]"), _Item(_calls_nothing, "tests/t.py::base_two")
    items = [other, named, near, case, killer, last]
    order(None, items)
    assert items == [case, killer, named, other, near, last]   # a base name takes each of its cases, only its own

    monkeypatch.setattr(mutants, "KILLS", tmp_path / "kills.json")
    old = mutants.MUTANTS[0].name   # catalogued, not run this time
    (tmp_path / "kills.json").write_text(f'{{"{old}": "tests/a.py::t", "m": "tests/b.py::was", "retired": "tests/c.py"}}')
    m, n = Mutant("m", "a.py::f", "x", "y", "bug"), Mutant("n", "a.py::f", "x", "y", "bug")
    mutants.record_kills([mutants.Result(m, "killed", "tests/b.py::now", 1.0, ""),
                          mutants.Result(n, "SURVIVED", "", 1.0, "")])
    assert mutants.load_kills() == {"m": "tests/b.py::now", old: "tests/a.py::t"}


def test_the_smoke_tier_runs_first_then_the_heaviest_tests_longest_first_then_the_rest_in_order():
    spec = importlib.util.spec_from_file_location("root_conftest", _PATH.parent.parent / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    item = lambda nodeid: SimpleNamespace(nodeid=nodeid)   # noqa: E731
    plain, other = item("tests/test_text.py::test_a"), item("tests/test_cli.py::test_b")
    whole_file = next(h for h in conftest.HEAVY if "::" not in h)   # a module listed whole
    heavy = [item(conftest.HEAVY[0] + "[case0]"), item(whole_file + "::test_any_of_its_module")]
    smoke = item(conftest.SMOKE[0])
    items = [plain, heavy[1], smoke, other, heavy[0]]
    items.sort(key=conftest._tiers)
    assert items == [smoke, heavy[0], heavy[1], plain, other]


def test_a_failed_node_id_is_read_whole_even_with_spaces_in_its_parameters():
    out = ("FAILED tests/t.py::test_a[blend r=0.15, staged] - AssertionError: x - y\n"
           "ERROR tests/u.py - ImportError\nFAILED tests/t.py::test_b\n")
    assert mutants.failed_nodes(out) == ["tests/t.py::test_a[blend r=0.15, staged]", "tests/u.py", "tests/t.py::test_b"]
