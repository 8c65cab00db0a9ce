"""pyproject.toml is the one list of dependencies; environment.yml must say the same."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["lab"] \
        + project["optional-dependencies"]["test"]
    return dict(_split(r) for r in reqs)


def environment_requirements() -> dict[str, str]:
    text = (ROOT / "environment.yml").read_text()
    block = text.split("dependencies:", 1)[1]
    found = {}
    for line in block.splitlines():
        match = re.match(r"^  - ([A-Za-z0-9_.-]+)(.*)$", line)
        if match and match.group(1) not in ("python", "pip"):
            name, spec = _split(match.group(1) + match.group(2).strip())
            found[CONDA_NAMES.get(name, name)] = spec
    return found


def _split(requirement: str) -> tuple[str, str]:
    match = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", requirement.strip())
    return match.group(1).lower(), match.group(2).replace(" ", "")


def test_environment_yml_lists_what_pyproject_lists():
    assert environment_requirements() == pyproject_requirements()


def test_environment_installs_the_package_itself():
    text = (ROOT / "environment.yml").read_text()
    assert re.search(r"^\s+- pip:\s*\n\s+- -e \.\s*$", text, re.M)
    assert "python=3.11" in text


def test_torch_ranges_admit_the_cached_wheels():
    reqs = pyproject_requirements()
    for name, version in (("torch", (2, 14, 1)), ("torchvision", (0, 29, 1))):
        spec = reqs[name]
        for op, bound in re.findall(r"(>=|<=|<|==|>)([\d.]+)", spec):
            b = tuple(int(x) for x in bound.split("."))
            assert {">=": version >= b, "<=": version <= b, "<": version < b,
                    "==": version == b, ">": version > b}[op], (name, spec)
