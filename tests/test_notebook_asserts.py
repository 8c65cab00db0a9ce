"""Every assert in a notebook checks something a run or a computation produced.

The rule (from the course's style guide): an assert whose operands are all literals or names
the notebook set itself proves nothing; it holds by construction. Each assert is split into its
claims (the parts of a top-level ``and``), and every claim must depend on a *produced* value.

What counts as produced is decided by following the notebook's own assignments, cell by cell,
statement by statement:

- a literal is not produced; neither is a builtin applied to non-produced values
  (``len([1, 2])``, ``sorted(xs)`` of a literal list);
- a name is produced when the value it was last set from is: ``x = 1024`` is a constant,
  ``run = ddplab.launch(...)`` and ``s = run.summary`` are produced, in the same cell or not;
- anything that goes through code (an imported module, a function, a class, an object) is
  produced: ``dataparallel.scatter_sizes(32, 4)`` computes, ``run.ok`` reads a result;
- a name nobody set (an IPython global) counts as produced, so the rule never guesses.

So ``expected = 1024`` followed by ``assert expected == 1024`` fails, and so does ``assert 2 *
512 == 1024``; ``s = run.check().summary`` followed by ``assert s["loss"] < 1`` passes.
Echoes this rule cannot see (comparing a run's report of a flag with the flag you passed,
recomputing what the worker computed) are for review; the notebooks avoid them too.

Run ``python tests/test_notebook_asserts.py [notebook ...]`` to list every assert with its
verdict.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import pytest

from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))
BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True)
class AssertClaim:
    """One claim of one assert: where it is, its text, and whether it checks a produced value."""

    cell: int
    line: int
    text: str
    produced: bool

    def __str__(self) -> str:
        return f"cell {self.cell}, line {self.line}: assert {self.text}"


class Provenance:
    """Follows a notebook's assignments and judges each assert's claims (see the module doc)."""

    def __init__(self) -> None:
        self.produced: dict[str, bool] = {}
        self.claims: list[AssertClaim] = []
        self.cell = 0
        self.nested = 0  # inside if/for/while/try/with: an assignment may not happen

    # -------------------------------------------------------------------- expressions

    def is_produced(self, node: Optional[ast.AST]) -> bool:
        """True when ``node`` depends on code or on a produced name."""
        if node is None:
            return False
        local = _bound_inside(node)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                if sub.id in local:
                    continue
                if sub.id in self.produced:
                    if self.produced[sub.id]:
                        return True
                elif sub.id not in BUILTINS:
                    return True  # set outside the notebook's code (an IPython global)
        return False

    # -------------------------------------------------------------------- statements

    def bind(self, target: ast.AST, produced: bool) -> None:
        """Record that ``target`` was set from a value that is (or is not) produced."""
        if isinstance(target, ast.Name):
            old = self.produced.get(target.id, False)
            self.produced[target.id] = produced or (self.nested > 0 and old)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.bind(element, produced)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, produced)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            base = _base_name(target)
            if base is not None:  # x.a = v or x[k] = v changes the object x names
                self.produced[base] = self.produced.get(base, False) or produced

    def run(self, statements: Iterable[ast.stmt]) -> None:
        for node in statements:
            self.statement(node)

    def statement(self, node: ast.stmt) -> None:
        for walrus in (n for n in ast.walk(node) if isinstance(n, ast.NamedExpr)):
            self.bind(walrus.target, self.is_produced(walrus.value))
        if isinstance(node, ast.Assign):
            produced = self.is_produced(node.value)
            for target in node.targets:
                self.bind(target, produced)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            if node.value is not None:
                produced = self.is_produced(node.value) or (
                    isinstance(node, ast.AugAssign) and self.is_produced(node.target))
                self.bind(node.target, produced)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                self.produced[(alias.asname or alias.name).split(".")[0]] = True
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.produced[node.name] = True
        elif isinstance(node, ast.Expr):
            self.mutation(node.value)
        elif isinstance(node, ast.Assert):
            for claim in _claims(node.test):
                self.claims.append(AssertClaim(self.cell, node.lineno, ast.unparse(claim),
                                               self.is_produced(claim)))
        else:
            self.compound(node)

    def mutation(self, call: ast.expr) -> None:
        """``xs.append(v)`` and the like: ``xs`` becomes produced if ``v`` is."""
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            base = _base_name(call.func)
            args = [*call.args, *(k.value for k in call.keywords)]
            if base is not None and any(self.is_produced(a) for a in args):
                self.produced[base] = True

    def compound(self, node: ast.stmt) -> None:
        """if/for/while/with/try: bind loop and ``as`` names, then follow every branch."""
        self.nested += 1
        if isinstance(node, (ast.For, ast.AsyncFor)):
            self.bind(node.target, self.is_produced(node.iter))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, self.is_produced(item.context_expr))
        for field in ("body", "orelse", "finalbody"):
            self.run(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            if handler.name:
                self.produced[handler.name] = True
            self.run(handler.body)
        self.nested -= 1


def _claims(test: ast.expr) -> Iterator[ast.expr]:
    """The claims of an assert: ``assert a and b`` makes two."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        for value in test.values:
            yield from _claims(value)
    else:
        yield test


def _base_name(node: ast.AST) -> Optional[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _bound_inside(node: ast.AST) -> set[str]:
    """Names bound by comprehensions and lambdas inside ``node`` (their values come from
    their iterables and arguments, which are judged where they appear)."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.comprehension):
            names |= {n.id for n in ast.walk(sub.target) if isinstance(n, ast.Name)}
        elif isinstance(sub, ast.Lambda):
            names |= {a.arg for a in ast.walk(sub.args) if isinstance(a, ast.arg)}
    return names


def _python(source: str) -> str:
    """A cell's code with IPython magics and shell lines (``%...``, ``!...``) made inert."""
    return re.sub(r"^(\s*)[%!].*$", r"\1pass", source, flags=re.M)


def analyse_cells(cells: Iterable[str]) -> list[AssertClaim]:
    """Judge the claims of every assert in a sequence of code cells (in notebook order)."""
    provenance = Provenance()
    for index, source in enumerate(cells):
        provenance.cell = index
        provenance.run(ast.parse(_python(source)).body)
    return provenance.claims


def analyse_notebook(path: Path) -> list[AssertClaim]:
    """Judge every assert of a notebook; claims carry the notebook's cell numbers."""
    cells = json.loads(path.read_text())["cells"]
    code = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    claims = analyse_cells(source for _, source in code)
    return [AssertClaim(code[c.cell][0], c.line, c.text, c.produced) for c in claims]


# ----------------------------------------------------------------------------- the notebooks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_assert_checks_a_produced_value(path):
    claims = analyse_notebook(path)
    assert claims, f"{path.name} has no assert at all"
    echoes = [str(c) for c in claims if not c.produced]
    assert not echoes, (
        f"{path.name}: these asserts check only literals or values the notebook set itself, "
        "so they hold by construction; assert on what a launch or a computation produced:\n  "
        + "\n  ".join(echoes))


# ----------------------------------------------------------------------------- the rule


def verdicts(*cells: str) -> list[bool]:
    return [c.produced for c in analyse_cells(cells)]


@pytest.mark.parametrize("cells, expected", [
    # literals and names set from literals: by construction
    (["assert 2 * 512 == 1024"], [False]),
    (["expected = 1024\nassert expected == 1024"], [False]),
    (["a, b = 1, 2\nassert a < b"], [False]),
    (["xs = [1, 2]\nassert len(xs) == 2 and sorted(xs) == xs"], [False, False]),
    (["N = 1347", "per_rank = N // 2 + 1\nassert per_rank == 674"], [False]),   # cells apart
    (["flag = True\nx = 3 if flag else 4\nassert x == 3"], [False]),
    # produced: launches, results, calls into code, in the same cell or an earlier one
    (["import ddplab\nrun = ddplab.launch('w.py', 2)\nassert run.ok"], [True]),
    (["import ddplab\nrun = ddplab.launch('w.py', 2)", "s = run.summary\nassert s['x'] > 0"],
     [True]),
    (["from ddplab.lab.demos import dataparallel\n"
      "assert dataparallel.scatter_sizes(32, 4) == [8, 8, 8, 8]"], [True]),
    (["import ddplab\nr = ddplab.launch('w')", "assert r.ok and 2 > 1"], [True, False]),
    (["import m\nrows = []\nfor x in m.items():\n    rows.append(x)\nassert rows"], [True]),
    (["import m\nvalues = [v * 2 for v in m.values()]\nassert all(v > 0 for v in values)"],
     [True]),
    (["import m\nassert all(x > 0 for x in [1, 2])"], [False]),
    (["import m\nif m.gpus:\n    n = m.gpus\nelse:\n    n = 2\nassert n >= 2"], [True]),
    (["assert get_ipython() is not None"], [True]),                  # set outside the code
    (["import m\n%time x = 1\nassert m.f()"], [True]),                # magics are skipped
])
def test_the_rule_on_small_examples(cells, expected):
    assert verdicts(*cells) == expected


def test_a_name_set_later_from_a_constant_is_a_constant_again():
    assert verdicts("import m\nx = m.f()\nx = 5\nassert x == 5") == [False]


def test_claims_are_reported_with_notebook_cell_numbers(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["# title"]},
                    {"cell_type": "code", "source": ["import m\n", "r = m.run()"]},
                    {"cell_type": "code", "source": ["k = 3\n", "assert k == 3 and r.ok"]}]}
    path = tmp_path / "00_x.ipynb"
    path.write_text(json.dumps(nb))
    claims = analyse_notebook(path)
    assert [(c.cell, c.line, c.text, c.produced) for c in claims] == [
        (2, 2, "k == 3", False), (2, 2, "r.ok", True)]


if __name__ == "__main__":
    for name in sys.argv[1:] or [p.name for p in NOTEBOOKS]:
        notebook = ROOT / "notebooks" / name if not Path(name).exists() else Path(name)
        print(f"== {notebook.name}")
        for claim in analyse_notebook(notebook):
            print(f"  {'ok  ' if claim.produced else 'ECHO'} {claim}")
