"""Whether a handed-in exercise is a shipped reference: copied, or imported and run.

``ddplab check`` (a learner's folder or a class's ``--submissions``) asks :func:`copied` before
launching an exercise; a copy gets the verdict "copied from the reference" instead of a run.
The references are what ships with the course: the capstone's reference job
(``ddplab/workers/capstone.py``) and, in a clone, the solutions the tests run
(``tests/solutions/<exercise>.py``).

What is compared is syntax, not text. Each file is parsed; docstrings and comments go, and every
name the author chose (variables, functions, classes, arguments) becomes one placeholder, while
the API (attributes, keyword names, imported modules) and constants stay. The file is then a
sequence of statements (a compound statement counts by its header), and what the skeleton
already holds is set aside: the learner's own part is compared, as runs of
:data:`SHINGLE` consecutive statements, with the reference's own part. A submission is a copy

- when it imports a reference or names it in a string (``import ddplab.workers.capstone``,
  ``runpy.run_module(...)``, ``torchrun -m ...``, a path to ``tests/solutions/``);
- when its module docstring is the reference's (and not the skeleton's);
- when at least :data:`SHARE` of its own statement runs are the reference's, and those make up
  at least :data:`SHARE` of the reference's own part, which must be :data:`LEAST` statements or
  more: an answer of a few lines (most exercises' gaps) is the same whoever writes it.

What it does not catch: a copier who rewrites the code (reorders it, restructures the loops,
inlines the helpers), an import built at run time (``importlib.import_module("ddplab." + x)``),
a copy of a solution that does not ship with ddplab, and answers to the small gaps.

Lessons: the coding exercises of 03-13 (``ddplab check``).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Optional

#: Consecutive statements compared as one run: a run of this many is rarely written alike twice.
SHINGLE = 3
#: The share of the learner's own runs found in the reference (and of the reference's own part
#: found in the learner's) that makes a copy.
SHARE = 0.8
#: The fewest statements of its own a reference needs for its runs to be compared at all.
LEAST = 25
#: The reference job the capstone's judge compares with, by module name.
CAPSTONE = "ddplab.workers.capstone"


def references(key: str, skeleton: str) -> dict[str, Path]:
    """The shipped references of exercise ``key`` (its file ``skeleton``): how each is named in
    a verdict -> its path. The capstone's reference job always; the tests' solution in a clone."""
    from ..workspace import PACKAGE, shipped_dir

    found = {}
    if key == "13":
        found[CAPSTONE] = PACKAGE / "workers" / "capstone.py"
    try:
        solution = shipped_dir() / "tests" / "solutions" / skeleton
    except FileNotFoundError:
        solution = None
    if solution is not None and solution.is_file():
        found[f"tests/solutions/{skeleton}"] = solution
    return found


def copied(key: str, submission: Path, skeleton: Path,
           found: Optional[dict[str, Path]] = None) -> Optional[str]:
    """What ``submission`` (exercise ``key``) copied, imported or runs of a shipped reference,
    in words ("imports ddplab.workers.capstone (line 3)"), or None when it is its own.

    ``skeleton`` is the shipped exercise file; ``found`` the references (default:
    :func:`references`). A file that does not parse is nobody's copy (its run will say why).
    """
    found = references(key, skeleton.name) if found is None else found
    mine = _parse(submission.read_text(errors="replace"))
    if mine is None or not found:
        return None
    hint = _names_a_reference(mine, found)
    if hint:
        return hint
    given = _parse(skeleton.read_text()) if skeleton.is_file() else None
    for name, path in found.items():
        theirs = _parse(path.read_text())
        if theirs is None:
            continue
        doc = ast.get_docstring(theirs)
        if doc and doc == ast.get_docstring(mine) and doc != (given and ast.get_docstring(given)):
            return f"its module docstring is {name}'s (the reference's own, not the skeleton's)"
        share = _shared(mine, theirs, given)
        if share:
            return f"{share} are {name}'s (compared as syntax trees, names aside)"
    return None


def _parse(text: str) -> Optional[ast.Module]:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


# ------------------------------------------------------------------ named: imported or run


def _names_a_reference(tree: ast.Module, found: dict[str, Path]) -> Optional[str]:
    modules = {name for name in found if not name.endswith(".py")}
    paths = {str(Path(*path.parts[-2:])) for path in found.values()}   # workers/capstone.py
    paths |= {name for name in found if name.endswith(".py")}          # tests/solutions/x.py
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, modules):
                    return f"it imports {alias.name} (line {line}), the reference job"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if _within(node.module, modules) or _within(f"{node.module}.{alias.name}",
                                                            modules):
                    return (f"it imports {alias.name} from {node.module} (line {line}), the "
                            "reference job")
            if node.module == "solutions" or node.module.startswith("solutions."):
                return f"it imports the tests' solutions (line {line})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in prose:   # a docstring may name the reference
            text = node.value.replace("\\", "/")
            named = next((m for m in sorted(modules | paths) if m in text), None)
            if named:
                return f"it names {named} in a string (line {line}): it runs the reference"
    return None


def _within(module: str, modules: set[str]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in modules)


# ------------------------------------------------------------------ copied: the same syntax


class _Anonymous(ast.NodeTransformer):
    """Docstrings out; every name the author chose becomes ``_``."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Name(id="_", ctx=node.ctx)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return ast.arg(arg="_")

    def visit_alias(self, node: ast.alias) -> ast.AST:
        return ast.alias(name=node.name, asname=node.asname and "_")

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name in ("name",):   # functions, classes, except handlers
            if isinstance(getattr(node, name, None), str) and not isinstance(node, ast.alias):
                setattr(node, name, "_")
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]   # type: ignore[attr-defined]
        return super().generic_visit(node)


def statements(tree: ast.Module) -> list[str]:
    """The file as a sequence of statements, each as its anonymous syntax (a compound statement
    by its header: its body's statements follow it), in source order."""
    tree = _Anonymous().visit(ast.parse(ast.unparse(tree)))
    out: list[str] = []

    def walk(body: list[ast.stmt]) -> None:
        for stmt in body:
            inner = [f for f in ("body", "orelse", "finalbody", "handlers", "cases")
                     if isinstance(getattr(stmt, f, None), list)]
            if not inner:
                out.append(ast.dump(stmt))
                continue
            head = {f: getattr(stmt, f) for f in inner}
            for f in inner:
                setattr(stmt, f, [])
            out.append(ast.dump(stmt))
            for f in inner:
                for part in head[f]:
                    if isinstance(part, (ast.ExceptHandler, ast.match_case)):
                        out.append(type(part).__name__)
                        walk(part.body)
                    else:
                        walk([part])
    walk(tree.body)
    return out


def _own(tree: ast.Module, given: Optional[ast.Module]) -> list[str]:
    """The statements of ``tree`` that the skeleton ``given`` does not hold (as many times)."""
    left = Counter(statements(given)) if given is not None else Counter()
    own = []
    for stmt in statements(tree):
        if left[stmt]:
            left[stmt] -= 1
        else:
            own.append(stmt)
    return own


def _runs(stmts: list[str]) -> Counter:
    return Counter(tuple(stmts[i:i + SHINGLE]) for i in range(max(0, len(stmts) - SHINGLE + 1)))


def _shared(mine: ast.Module, theirs: ast.Module, given: Optional[ast.Module]) -> Optional[str]:
    """"31 of the 33 runs of statements it wrote" when the learner's own part is the
    reference's (both ways, :data:`SHARE`), else None."""
    ref_own = _own(theirs, given)
    if len(ref_own) < LEAST:
        return None
    my_runs, ref_runs = _runs(_own(mine, given)), _runs(ref_own)
    common = sum((my_runs & ref_runs).values())
    total, ref_total = sum(my_runs.values()), sum(ref_runs.values())
    if total and common >= SHARE * total and common >= SHARE * ref_total:
        return f"{common} of the {total} runs of {SHINGLE} statements it wrote"
    return None
