"""No test and no notebook asserts on torch's or Python's message text.

A test asserts ddplab's behaviour: which rank failed, which kind of fault, which hint ddplab
gives. torch's faults are recognised by exception type, exit signal or code, or structured
data; where only words exist, by a pattern of ``ddplab/torch_words.py``, the one versioned
file of such words (the named exception: it is tested against the real faults on the floor and
the newest torch, ``tests/test_torch_words.py``).

What is read, with ``ast``, in every test file and every notebook code cell: the text given to
``match=``, a literal compared in an ``assert`` (``"..." in x``, ``x == "..."``,
``x.startswith("...")``), and the pattern given to ``error_lines``/``re.search``. Such a
literal is someone else's wording, and refused, when it is part of a line ``torch_words``
records as seen from torch or Python; otherwise it is accepted when it is the test's own (it
appears in another string of the same file, or in a script the tests run) or ddplab's own (its
words occur in ddplab's source outside docstrings and ``torch_words``, and it is a phrase, not
one bare word compared with a raw exception's text, which could be anybody's). Reading the bytes
of ``torch.save``'s pickle (``data.pkl``) is refused too.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
import warnings
from pathlib import Path

import pytest

from ddplab import torch_words

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ddplab"
PATTERN_FILE = PACKAGE / "torch_words.py"
TEST_FILES = sorted(p for p in (ROOT / "tests").rglob("*.py")
                    if not p.is_relative_to(ROOT / "tests" / "scripts")
                    and not p.is_relative_to(ROOT / "tests" / "solutions")
                    and p != Path(__file__).resolve())
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# What the tests run: a phrase one of these prints is the test's own.
SCRIPTS = sorted([*(ROOT / "tests" / "scripts").rglob("*.py"),
                  *(ROOT / "tests" / "solutions").rglob("*.py")])

SEEN = [line for words in torch_words.ALL for _, line in words.seen]
BUILTIN_ERRORS = {name for name in dir(builtins)
                  if name.endswith(("Error", "Exception", "Warning"))}
# A subject that holds raw exception or process text (not a ddplab result field).
RAW = re.compile(r"^(str|repr)\(|\.args$|^(excinfo|exc)\b|error_lines\(")


def strings(tree: ast.AST) -> list[str]:
    """Every string constant of ``tree``, f-strings' fixed parts included."""
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def ddplab_raises() -> dict[str, str]:
    """The strings of ddplab's own exceptions and warnings, by class name (``raise X(...)``,
    ``warnings.warn(..., X)``)."""
    parts: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PATTERN_FILE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = ast.unparse(node.exc.func)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("warn"):
                category = [*node.args[1:2], *(k.value for k in node.keywords
                                               if k.arg == "category")]
                name = ast.unparse(category[0]) if category else "UserWarning"
            else:
                continue
            parts.setdefault(name.split(".")[-1], []).extend(strings(node))
    return {name: "\0".join(texts) for name, texts in parts.items()}


def ddplab_words() -> str:
    """ddplab's own strings (messages, hints, f-strings' fixed parts), docstrings left out."""
    parts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PATTERN_FILE:
            continue
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        parts += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and id(n) not in skip]
    return "\0".join(parts)


DDPLAB = ddplab_words()
RAISED = ddplab_raises()
DDPLAB_WORDS = {w for w in re.findall(r"[A-Za-z_][A-Za-z_]+", DDPLAB)}
SCRIPT_WORDS = {w for path in SCRIPTS for w in re.findall(r"[A-Za-z_][A-Za-z_]+",
                                                           path.read_text())}


def asserted(tree: ast.AST) -> tuple[set[str], set[int]]:
    """The names an ``assert`` reads, directly or through assignments, and the ids of the
    calls whose values reach one (so a search whose lines are only printed is not read)."""
    names = {n.id for a in ast.walk(tree) if isinstance(a, ast.Assert)
             for n in ast.walk(a) if isinstance(n, ast.Name)}
    assigns = [a for a in ast.walk(tree) if isinstance(a, (ast.Assign, ast.AnnAssign))]
    while True:
        more = {n.id for a in assigns if a.value is not None
                and any(isinstance(t, ast.Name) and t.id in names
                        for target in (a.targets if isinstance(a, ast.Assign) else [a.target])
                        for t in ast.walk(target))
                for n in ast.walk(a.value) if isinstance(n, ast.Name)} - names
        if not more:
            break
        names |= more
    reach = {id(c) for a in ast.walk(tree) if isinstance(a, ast.Assert) for c in ast.walk(a)}
    for a in assigns:
        targets = a.targets if isinstance(a, ast.Assign) else [a.target]
        if a.value is not None and any(isinstance(t, ast.Name) and t.id in names
                                       for target in targets for t in ast.walk(target)):
            reach |= {id(c) for c in ast.walk(a.value)}
    return names, reach


def candidates(tree: ast.AST) -> list[tuple[int, str, str, str]]:
    """(line, literal, what it is compared with, the exception class for match=)."""
    found = []
    _, reach = asserted(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            for keyword in node.keywords:
                if keyword.arg == "match" and isinstance(keyword.value, ast.Constant) and \
                        isinstance(keyword.value.value, str):
                    cls = ast.unparse(node.args[0]) if node.args else ""
                    found.append((node.lineno, keyword.value.value, "match=", cls))
            if name.endswith(("error_lines", "re.search", "re.match", "re.findall")) and \
                    id(node) in reach:
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.append((node.lineno, arg.value, name + "(", ""))
        if isinstance(node, ast.Assert):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.Compare):
                    sides = [sub.left, *sub.comparators]
                    for i, op in enumerate(sub.ops):
                        left, right = sides[i], sides[i + 1]
                        if isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq)):
                            for lit, other in ((left, right), (right, left)):
                                if isinstance(lit, ast.Constant) and isinstance(lit.value, str):
                                    found.append((sub.lineno, lit.value, ast.unparse(other), ""))
                elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and \
                        sub.func.attr in ("startswith", "endswith"):
                    for arg in sub.args:
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                            found.append((sub.lineno, arg.value, ast.unparse(sub.func.value), ""))
    return found


def vocabulary(texts: list[str]) -> set[str]:
    return {w for text in texts for w in re.findall(r"[A-Za-z_][A-Za-z_]+", text)}


def verdict(literal: str, subject: str, cls: str, own: list[str]) -> str:
    """Why ``literal`` is someone else's wording, or "" when it is the test's or ddplab's."""
    phrase = literal.strip()
    if " " in phrase and len(phrase) >= 8 and any(phrase in line for line in SEEN):
        return "torch's or Python's words (ddplab.torch_words has them: use its pattern)"
    words = re.findall(r"[A-Za-z_][A-Za-z_]+", literal)
    if not words:
        return ""  # a number, an address, a separator: not wording
    raw = subject == "match=" and cls.split(".")[-1] in BUILTIN_ERRORS or \
        subject != "match=" and bool(RAW.search(subject))
    # a word of ddplab's own exceptions or warnings (of that class, for match=)
    said = RAISED.get(cls.split(".")[-1], "") if subject == "match=" else \
        "\0".join(RAISED.values())
    ddplabs = bool(re.search(rf"(?<!\w){re.escape(literal)}(?!\w)", said))
    if raw and " " not in phrase and own.count(literal) < 2 and not ddplabs:
        return "one bare word in a raw exception's text: whose words is it?"
    unknown = set(words) - DDPLAB_WORDS - SCRIPT_WORDS - vocabulary(own)
    if unknown:
        return f"not ddplab's words, nor the test's own: {sorted(unknown)}"
    return ""


def sources() -> list[tuple[str, str]]:
    """(name, Python code) of every test file and every notebook's code cells."""
    found = [(str(path.relative_to(ROOT)), path.read_text()) for path in TEST_FILES]
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        for index, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                code = "".join(cell["source"])
                code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                                 for line in code.splitlines())
                found.append((f"{path.relative_to(ROOT)} cell {index}", code))
    return found


def offences(name: str, code: str, own: list[str]) -> list[tuple[int, str, str]]:
    """(line, literal, why) for every assert on someone else's wording in ``code``."""
    tree = ast.parse(code)
    found = [(line, literal, why) for line, literal, subject, cls in candidates(tree)
             if (why := verdict(literal, subject, cls, own))]
    found += [(0, text, "reads torch.save's pickle: use torch's API (map_location, "
               "torch.serialization.register_package) instead")
              for text in strings(tree) if "data.pkl" in text]
    return found


# Known, left for the changes that rework these files (issue 25): (file, literal). Each must
# still be found (mend the file, then strike its line here); nothing else may be.
PENDING: set[tuple[str, str]] = set()  # (file, words) left to the change that owns the file


def test_no_test_or_notebook_asserts_on_torch_or_python_wording():
    every = sources()
    by_file: dict[str, list[str]] = {}
    for name, code in every:
        by_file.setdefault(name.split(" cell ")[0], []).extend(strings(ast.parse(code)))
    found = {(name.split(" cell ")[0], literal): f"{name}:{line}: {literal!r} ({why})"
             for name, code in every for line, literal, why
             in offences(name, code, by_file[name.split(" cell ")[0]])}
    new = [text for key, text in found.items() if key not in PENDING]
    assert not new, ("assert ddplab's behaviour, and recognise torch's faults by type, "
                     "signal or data, or through ddplab.torch_words:\n" + "\n".join(new))
    mended = sorted(PENDING - set(found))
    assert not mended, f"no longer found, strike them from PENDING: {mended}"


@pytest.mark.parametrize("code, caught", [
    ('import pytest\nwith pytest.raises(RuntimeError, match="module"):\n    pass\n', True),
    ('assert "Timed out" in result.root_cause.message\n', True),
    ('assert "map_location" in str(error)\n', True),
    ('lines = postmortem.error_lines(result, 0, "Detected mismatch")\nassert lines\n', True),
    ('lines = postmortem.error_lines(result, 0, "Detected mismatch")\nprint(lines)\n', False),
    ('names = postmortem.error_lines(result, 0, "aux.weight")\nassert any(names)\n', True),
    ('assert "unrecognized arguments: --local-rank=1" in result.error\n', True),
    ("assert \"Can't get attribute 'hello' on <module '__main__'\" in out.stdout\n", True),
    ('import zipfile\nzipfile.ZipFile("c.pt").read("archive/data.pkl")\n', True),
    ('assert "rank 1 exited with code 3" in result.error\n', False),
    ('assert "no usable GPU" in result.root_cause.hint\n', False),
    ('import pytest\nwith pytest.raises(checkpoint.CheckpointError, match="state_dict"):\n'
     '    pass\n', False),
    ('raise OSError("disk full")\nimport pytest\nwith pytest.raises(OSError, match="disk full")'
     ':\n    pass\n', False),
    ('assert metric(result, "steps") == {1: 2}\n', False),
    ('assert torch_words.COLLECTIVE_TIMEOUT.search(text)\n', False),
])
def test_the_reader_catches_the_patterns_it_is_for_and_spares_ddplabs_words(code, caught):
    own = strings(ast.parse(code))
    assert bool(offences("example", code, own)) == caught, offences("example", code, own)


def copies_of_seen_words(texts: list[str]) -> list[str]:
    """The phrases or patterns among ``texts`` that match a line torch_words records."""
    copied = []
    for text in texts:
        if len(text) < 12 or " " not in text:
            continue
        try:
            with warnings.catch_warnings():  # any string, read as a pattern: quiet about it
                warnings.simplefilter("ignore")
                pattern = re.compile(text)
        except re.error:
            pattern = re.compile(re.escape(text))
        if any(len(m.group(0)) >= 10 for line in SEEN for m in pattern.finditer(line)):
            copied.append(text)
    return copied


def test_ddplab_keeps_others_words_in_torch_words_only():
    """Outside the pattern file (and docstrings) no ddplab string, plain or a regular
    expression, matches a line torch_words records: the patterns are not copied elsewhere."""
    assert copies_of_seen_words(["a different sentence", "Timed out waiting \\d+ms"]) == [
        "Timed out waiting \\d+ms"]
    copied = set(copies_of_seen_words(DDPLAB.split("\0")))
    assert copied <= set(PENDING_COPIES), \
        f"torch's or Python's words outside ddplab/torch_words.py: {copied - set(PENDING_COPIES)}"
    assert copied == set(PENDING_COPIES), \
        f"strike these from PENDING_COPIES: {set(PENDING_COPIES) - copied}"


# Left to the change that owns the file (issue 25); each must still be there.
PENDING_COPIES: dict[str, str] = {}
