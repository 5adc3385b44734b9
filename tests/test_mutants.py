"""The mutation catalogue (scripts/mutants.py): every catalogued bug is anchored in this tree (its function, and a
pattern found once in it), the anchors survive reformatting and moves but fail, one mutant at a time and by name,
when the code they name is gone, old-format entries are refused except by the re-anchoring helper, and the CI
selection kills each bug. All but the kill run are cheap and run in CI; the kill run takes about half an hour on 2
cores (`slow`, weekly)."""
import ast
import importlib.util
import io
import re
import shutil
import sys
import tokenize
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_PATH = ROOT / "scripts" / "mutants.py"
_spec = importlib.util.spec_from_file_location("mutants", _PATH)
mutants = importlib.util.module_from_spec(_spec)
sys.modules["mutants"] = mutants     # dataclasses look their module up by name
_spec.loader.exec_module(mutants)

MUTANTS = mutants.MUTANTS
HOSTED = sorted({m.path for m in MUTANTS})
PYTHON = [m for m in MUTANTS if m.path.endswith(".py")]     # README.md's mutants have no functions to rename


def test_every_mutant_applies_to_the_tree_exactly_once():
    """Each anchor resolves: its function is there and holds its pattern once, and the edit compiles."""
    assert mutants.validate(MUTANTS) == []
    assert len(MUTANTS) >= 25
    for note in mutants.moved(MUTANTS):
        warnings.warn(note)


def _copy(tmp: Path, files=HOSTED) -> Path:
    for rel in files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp / rel)
    return tmp


def _defs(text: str):
    """(qualname, def node) of every function and class, nested ones too."""
    return mutants.Source._defs(ast.parse(text), "")


# ---- a function renamed, a pattern gone or doubled: that mutant alone fails, by name --------------------------
def _host(count_one: bool) -> str:
    """A function (not module-level code) that hosts one mutant, or several, and is defined once in its file."""
    counts = {w: sum(m.where == w for m in PYTHON) for w in {m.where for m in PYTHON}}
    for where in sorted(counts):
        path, _, qual = where.partition("::")
        names = [q for q, _ in _defs((ROOT / path).read_text())]
        if qual != mutants.MODULE and names.count(qual) == 1 and (counts[where] == 1) == count_one:
            return where
    raise AssertionError("no such host in the catalogue")


def _rename_def(text: str, qual: str, to: str) -> str:
    (node,) = [n for q, n in _defs(text) if q == qual]
    lines = text.splitlines(keepends=True)
    lines[node.lineno - 1] = re.sub(rf"\b(def|class) {node.name}\b", rf"\1 {to}", lines[node.lineno - 1], count=1)
    return "".join(lines)


@pytest.mark.parametrize("count_one", [True, False], ids=["one-mutant", "several-mutants"])
def test_renaming_a_function_fails_only_its_mutants_anchors_by_name(tmp_path, count_one):
    where = _host(count_one)
    path, _, qual = where.partition("::")
    tree = _copy(tmp_path)
    (tree / path).write_text(_rename_def((ROOT / path).read_text(), qual, qual.rsplit(".", 1)[-1] + "_renamed"))
    in_file = [m for m in MUTANTS if m.path == path]
    problems = mutants.validate(in_file, root=tree)
    hosted = [m.name for m in in_file if m.where == where]
    assert sorted(p.split(":")[0] for p in problems) == sorted(hosted)
    for p in problems:
        assert p.endswith(f"{path} has no function {qual}"), p
    assert len(hosted) == 1 if count_one else len(hosted) > 1


def _plain_line_mutant():
    """A mutant whose pattern is one whole line (its indentation, its code, its newline)."""
    return next(m for m in PYTHON if m.old[:1] == " " and m.old.endswith("\n") and m.old.count("\n") == 1
                and m.function != mutants.MODULE)


@pytest.mark.parametrize("change, message", [
    ("gone", "no longer holds its pattern"),
    ("doubled", "holds 2 times (needs exactly 1) its pattern"),
    ("uncompilable", "the edit leaves"),
])
def test_a_lost_pattern_fails_its_anchor_by_name(tmp_path, change, message):
    m = _plain_line_mutant()
    tree = _copy(tmp_path, [m.path])
    r = mutants.resolve(m)
    text = (ROOT / m.path).read_text()
    line = text[r.start:r.end]
    indent = line[:len(line) - len(line.lstrip())]
    edited = {"gone": indent + "pass\n", "doubled": line + line}.get(change, line)
    (tree / m.path).write_text(text[:r.start] + edited + text[r.end:])
    broken = m if change != "uncompilable" else mutants.Mutant(m.name, m.where, m.old, m.new + indent + "  )\n", m.bug)
    (problem,) = mutants.validate([broken], root=tree)
    assert problem.startswith(f"{m.name}: ") and message in problem, problem


def test_an_old_format_entry_is_refused_by_name():
    m = _plain_line_mutant()
    old_format = mutants.Mutant(m.name, m.path, m.old, m.new, m.bug)
    (problem,) = mutants.validate([old_format])
    assert problem.startswith(f"{m.name}: old format") and "--anchor" in problem, problem
    with pytest.raises(mutants.AnchorError, match=m.name):
        mutants.apply(old_format, ROOT)


def test_a_name_used_twice_is_refused():
    m = MUTANTS[0]
    assert mutants.validate([m, m]) == [f"{m.name}: the name is used twice"]


# ---- a function moved to another file: found there, reported, and --anchor writes its path --------------------
def _top_level_host() -> tuple[str, str]:
    for m in PYTHON:
        names = [q for q, _ in _defs((ROOT / m.path).read_text())]
        if m.function != mutants.MODULE and "." not in m.function and names.count(m.function) == 1:
            return m.path, m.function
    raise AssertionError("no top-level function hosts a mutant")


def _catalogue_entries(path: Path) -> dict[str, tuple]:
    (catalogue,) = [n.value for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign)
                    and [getattr(t, "id", None) for t in n.targets] == ["MUTANTS"]]
    return {args[0]: args for args in ([ast.literal_eval(a) for a in c.args] for c in catalogue.elts)}


def test_a_moved_function_keeps_its_mutants_and_anchor_updates_their_path(tmp_path):
    path, qual = _top_level_host()
    tree = _copy(tmp_path)
    text = (ROOT / path).read_text()
    (node,) = [n for q, n in _defs(text) if q == qual]
    lines = text.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    moved_to = str(Path(path).parent / "moved_here.py")
    (tree / moved_to).write_text("".join(lines[first:node.end_lineno]))
    (tree / path).write_text("".join(lines[:first] + lines[node.end_lineno:]))
    hosted = [m for m in MUTANTS if m.where == f"{path}::{qual}"]
    assert mutants.validate(hosted, root=tree) == []
    for m in hosted:
        assert mutants.resolve(m, mutants.Sources(tree)).path == moved_to
    assert mutants.moved(hosted, root=tree) == [
        f"{m.name}: moved: update path {path} -> {moved_to} (`python scripts/mutants.py --anchor`)" for m in hosted]

    catalogue = tmp_path / "catalogue.py"
    shutil.copyfile(_PATH, catalogue)
    done = mutants.reanchor_catalogue(catalogue, root=tree)
    assert done == [f"{m.name}: moved to {moved_to}" for m in hosted]
    entries = _catalogue_entries(catalogue)
    for m in hosted:
        assert tuple(entries[m.name]) == (m.name, f"{moved_to}::{qual}", m.old, m.new, m.bug)


# ---- the old format, converted: the anchored mutant plants the byte-identical file -----------------------------
def _old_format(name: str, path: str, old: str, new: str, bug: str) -> str:
    return f"    Mutant({name!r}, {path!r},\n           {old!r},\n           {new!r},\n           {bug!r}),\n"


def test_anchor_rewrites_an_old_format_entry_into_one_that_plants_the_same_file(tmp_path):
    """The lead's merge step: entries appended in the old format are rewritten in place, anchored; one whose text
    is not in its file is left as it was, and said so."""
    m = next(m for m in PYTHON if "\n" in m.new.rstrip("\n"))       # a multi-line edit, re-indented on its own
    r = mutants.resolve(m)
    text = (ROOT / m.path).read_text()
    exact_old = text[r.start:r.end]
    stale = _old_format(m.name + "_stale", m.path, "no_such_code()\n", "pass\n", m.bug)
    catalogue = tmp_path / "catalogue.py"
    source = _PATH.read_text()
    end = source.index("\n]\n", source.index("MUTANTS = [")) + 1
    catalogue.write_text(source[:end] + _old_format(m.name + "_old", m.path, exact_old, m.new, m.bug) + stale
                         + source[end:])
    (anchored, left) = mutants.reanchor_catalogue(catalogue)
    assert anchored == f"{m.name}_old: anchored at {m.where}"
    assert left.startswith(f"{m.name}_stale: {m.path} holds its old text 0 times") and left.endswith("left as is")
    entries = _catalogue_entries(catalogue)
    assert mutants.resolve(mutants.Mutant(*entries[m.name + "_old"])).mutated == text.replace(exact_old, m.new) \
        == r.mutated
    assert stale in catalogue.read_text()
    assert mutants.reanchor_catalogue(catalogue) == [left]      # a second run has nothing more to do


def test_anchor_refuses_an_old_text_it_cannot_place():
    m = _plain_line_mutant()
    with pytest.raises(mutants.AnchorError, match=rf"{m.name}_x: {m.path} holds its old text 0 times"):
        mutants.anchor(m.name + "_x", m.path, m.old + "no_such_code()", m.new, m.bug)


# ---- reformatting every file that hosts a mutant keeps every anchor, and plants the same bug -------------------
def _tokens(text: str):
    return list(tokenize.generate_tokens(io.StringIO(text).readline))


def _offsets(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _reindent(text: str) -> str:
    """Every line's indentation doubled (statements, continuation lines, string lines alike)."""
    return "".join(line[:len(line) - len(line.lstrip(" "))] + line for line in text.splitlines(keepends=True))


def _rewrap(text: str) -> str:
    """A line break after every comma inside brackets: every call, list and signature wrapped one item a line."""
    starts, depth, cuts = _offsets(text), 0, []
    for t in _tokens(text):
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            depth -= 1
        elif t.type == tokenize.OP and t.string == "," and depth:
            cuts.append(starts[t.end[0] - 1] + t.end[1])
    for cut in reversed(cuts):
        text = text[:cut] + "\n        " + text[cut:]
    return text


def _blank_lines(text: str) -> str:
    """A blank line after every statement."""
    ends = {t.end[0] for t in _tokens(text) if t.type == tokenize.NEWLINE}
    return "".join(line + ("\n" if i in ends else "") for i, line in enumerate(text.splitlines(keepends=True), 1))


def _rename_unrelated(text: str, hosts: set[str]) -> str:
    """Every function that neither hosts a mutant, nor holds or sits inside one that does, renamed (its def)."""
    related = lambda q: any(q == h or h.startswith(q + ".") or q.startswith(h + ".") for h in hosts)  # noqa: E731
    lines = text.splitlines(keepends=True)
    for qual, node in _defs(text):
        if isinstance(node, ast.FunctionDef) and not related(qual):
            lines[node.lineno - 1] = re.sub(rf"\bdef {node.name}\b", f"def {node.name}_elsewhere",
                                            lines[node.lineno - 1], count=1)
    return "".join(lines)


def _reformat(text: str, hosts: set[str]) -> str:
    return _rename_unrelated(_blank_lines(_rewrap(_reindent(text))), hosts)


class _Blank(ast.NodeTransformer):
    def visit_Constant(self, node):     # the doubled indentation reaches into multi-line strings
        return ast.Constant(re.sub(r"\s", "", node.value)) if isinstance(node.value, str) else node


def _function(text: str, qual: str) -> list[str]:
    """The shape of the function (every one of that qualname; module-level code: the module's statements other
    than definitions) in a file: its AST, string constants without whitespace."""
    tree, defs = ast.parse(text), (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    nodes = [n for n in tree.body if not isinstance(n, defs)] if qual == mutants.MODULE else \
        [n for q, n in mutants.Source._defs(tree, "") if q == qual]
    return [ast.dump(_Blank().visit(n)) for n in nodes]


def test_reformatting_keeps_every_anchor_and_plants_the_same_bug(tmp_path):
    """Indentation doubled, every bracketed list wrapped one item a line, a blank line after every statement and
    every unrelated function renamed, in every file that hosts a mutant: each mutant still resolves, and the
    function it lives in comes out of the edit as it does from the edit of the file as it is (the rest of the file
    is the reformatted one by construction: the edit stays inside the function)."""
    tree = _copy(tmp_path)
    for path in {m.path for m in PYTHON}:
        hosts = {m.function for m in PYTHON if m.path == path}
        (tree / path).write_text(_reformat((ROOT / path).read_text(), hosts))
    assert mutants.validate(MUTANTS, root=tree) == []
    sources, reformatted = mutants.Sources(ROOT), mutants.Sources(tree)
    for m in PYTHON:
        planted = mutants.resolve(m, reformatted).mutated
        expected = mutants.resolve(m, sources).mutated
        assert _function(planted, m.function) == _function(expected, m.function), \
            f"{m.name}: another bug once {m.path} is reformatted"


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_the_ci_selection_kills_the_mutant(name):
    result = mutants.run_one(next(m for m in MUTANTS if m.name == name))
    assert result.verdict == "killed", f"{name} ({result.mutant.bug}): {result.verdict}\n{result.tail}"


def test_every_smoke_entry_names_a_test_that_exists():
    """conftest.py's SMOKE orders the first tier by node id: a renamed test would silently leave it."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    for entry in conftest.SMOKE + conftest.HEAVY:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        assert not name or f"def {name}(" in (ROOT / path).read_text(), f"{entry}: no such test"


def test_recorded_kills_name_exactly_the_catalogue():
    """mutant_kills.json holds one killer, a test file that exists, for each catalogued mutant and for nothing else
    (a new mutant is run before it is committed)."""
    kills = mutants.load_kills()
    assert set(kills) == {m.name for m in MUTANTS}, sorted(set(kills) ^ {m.name for m in MUTANTS})
    assert all((ROOT / test.split("::")[0]).is_file() for test in kills.values())
