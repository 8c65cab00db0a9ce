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


def _floor(spec: str) -> tuple[int, ...]:
    match = re.search(r">=([\d.]+)", spec)
    assert match, f"{spec!r} declares no floor (>=)"
    return tuple(int(x) for x in match.group(1).split("."))


def test_declared_torch_floor_is_the_release_make_test_compat_runs():
    default = re.search(r"^TORCH \?= ([\d.]+)$", (ROOT / "Makefile").read_text(), re.M)
    assert default, "the Makefile sets no default TORCH for make test-compat"
    tested = tuple(int(x) for x in default.group(1).split("."))
    floor = _floor(pyproject_requirements()["torch"])
    assert tested[:len(floor)] == floor and not any(tested[len(floor):]), (
        f"pyproject.toml declares torch{pyproject_requirements()['torch']} but make test-compat "
        f"tests torch {default.group(1)}: declare the release the tests run on")


def test_torchvision_floor_is_the_one_made_for_the_torch_floor():
    reqs = pyproject_requirements()
    torch_major, torch_minor = _floor(reqs["torch"])[:2]
    # torchvision 0.(minor + 15) is built for torch 2.minor (2.6 -> 0.21, 2.14 -> 0.29)
    assert torch_major == 2
    assert _floor(reqs["torchvision"])[:2] == (0, torch_minor + 15), reqs["torchvision"]
