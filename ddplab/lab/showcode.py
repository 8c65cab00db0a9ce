"""Show the code a lesson teaches, straight from the real file (never a copy in the notebook).

Worker files mark teachable sections with comments::

    # [setup]
    info = setup()
    # [/setup]

Example::

    ddplab.show("ddplab/workers/train.py", "setup")   # one marked section
    ddplab.show(ddplab.train.train_epoch)              # a whole function or class

Lessons: every notebook (01-09).
"""

from __future__ import annotations

import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, Optional, Union

ROOT = Path(__file__).resolve().parents[2]


def source(obj: Union[str, Path, Any], section: Optional[str] = None) -> str:
    """Return the source text of a function/class/module, a file, or a marked file section.

    Args:
        obj: a Python object, or a path (absolute, relative to the course folder, such as
            ``"exercises/amp.py"``, or to the package's parent, such as
            ``"ddplab/workers/train.py"``), or a module name (``"ddplab.workers.train"``).
        section: the name of a ``# [name]`` ... ``# [/name]`` block in that file.

    Raises:
        KeyError: the section does not exist (the message lists those that do).
    """
    if not isinstance(obj, (str, Path)):
        return inspect.getsource(obj)
    path = _find(obj)
    text = path.read_text()
    if section is None:
        return text
    name = re.escape(section)
    match = re.search(rf"^[ \t]*# \[{name}\][^\n]*\n(.*?)^[ \t]*# \[/{name}\]",
                      text, re.S | re.M)
    if not match:
        names = re.findall(r"^[ \t]*# \[([\w-]+)\]", text, re.M)
        raise KeyError(f"no section {section!r} in {path}; sections: {', '.join(names)}")
    return textwrap.dedent(match.group(1)).rstrip("\n")


def show(obj: Union[str, Path, Any], section: Optional[str] = None) -> None:
    """Display ``source(obj, section)`` with syntax highlighting (plain text outside Jupyter)."""
    text = source(obj, section)
    try:
        from IPython import get_ipython
        from IPython.display import Code, display

        if get_ipython() is not None and hasattr(get_ipython(), "kernel"):
            display(Code(text, language="python"))
            return
    except ImportError:
        pass
    print(text)


def side_by_side(files: dict[str, Union[str, Path]], sections: list[str]) -> str:
    """Show the same-named sections of several files next to each other, one row per section.

    Args:
        files: column title -> file (as for ``source``), e.g.
            ``{"DDP": "ddplab/workers/loop_ddp.py"}``.
        sections: the ``# [name]`` sections every file has, in the order to show them.

    Returns:
        The table as HTML (displayed in Jupyter; outside it, each section is printed per file).

    Lesson: 07b.
    """
    import html

    cells = {(title, name): source(path, name)
             for title, path in files.items() for name in sections}
    head = "".join(f"<th style='text-align:left'>{html.escape(t)}</th>" for t in files)
    rows = "".join(
        f"<tr><td style='vertical-align:top'><b>{html.escape(name)}</b></td>" + "".join(
            "<td style='vertical-align:top;text-align:left'><pre style='font-size:11px'>"
            f"{html.escape(cells[title, name])}</pre></td>" for title in files) + "</tr>"
        for name in sections)
    table = f"<table><tr><th></th>{head}</tr>{rows}</table>"
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display

        if get_ipython() is not None and hasattr(get_ipython(), "kernel"):
            display(HTML(table))
            return table
    except ImportError:
        pass
    for name in sections:
        for title in files:
            print(f"--- {name}: {title}\n{cells[title, name]}")
    return table


def who_writes(files: dict[str, Union[str, Path]], sections: list[str], by_hand: list[str],
               own_calls: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """Tabulate what each file's code (its comments left out) writes by hand and calls.

    Args:
        files: column title -> file, as for ``side_by_side``.
        sections: the sections read in every file.
        by_hand: names looked for as text, e.g. ``"DistributedSampler"``: a "yes" or "-" each.
        own_calls: row name -> {column title: the call that file makes}, e.g.
            ``{"barrier": {"DDP": "dist.barrier"}}``: "dist.barrier x1", with the number of
            times the call (the name followed by "(") appears.

    Returns:
        One row per name in ``by_hand``, then one per row of ``own_calls`` ("a NAME (calls)"),
        each ``{"written by you": ..., title: ...}``, ready for ``plots.table``.

    Lesson: 07b.
    """
    code = {title: re.sub(r"#.*", "", "\n".join(source(path, s) for s in sections))
            for title, path in files.items()}
    rows = [{"written by you": name, **{t: "yes" if name in code[t] else "-" for t in files}}
            for name in by_hand]
    rows += [{"written by you": f"a {what} (calls)",
              **{t: f"{calls[t]} x{code[t].count(calls[t] + '(')}" for t in files}}
             for what, calls in own_calls.items()]
    return rows


def _find(name: Union[str, Path]) -> Path:
    from ..workspace import find_course

    candidate = Path(name)
    course = find_course()  # the learner's exercises/ when the notebooks run from a course folder
    for path in (candidate, *([course / candidate] if course else []), ROOT / candidate):
        if path.is_file():
            return path
    if isinstance(name, str) and not name.endswith(".py"):
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            return Path(spec.origin)
    raise FileNotFoundError(f"no file or module {name!r} (looked in {ROOT})")
