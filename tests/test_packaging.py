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


# The lock: what `make setup` installs and CI tests.
LOCK = ROOT / "requirements" / "lock.txt"


def lock_pins() -> list[tuple[str, str, str]]:
    """(name, version, environment marker or "") for every pin of the lock; a package locked
    differently for two Pythons or platforms (universal resolution) has a pin for each."""
    return [(m.group(1).lower().replace("_", "-"), m.group(2), m.group(3) or "")
            for m in re.finditer(r"^([A-Za-z0-9_.-]+)==([^\s;\\]+)\s*(?:;\s*([^\\\n]+?))?\s*\\?$",
                                 LOCK.read_text(), re.M)]


def here(name: str) -> list[str]:
    """The versions of ``name`` the lock installs on this Python and platform."""
    from packaging.markers import Marker

    return [version for pinned, version, marker in lock_pins()
            if pinned == name and (not marker or Marker(marker).evaluate())]


def test_the_lock_pins_every_dependency_within_its_declared_range():
    from packaging.specifiers import SpecifierSet

    pins = lock_pins()
    for name, spec in pyproject_requirements().items():
        versions = [version for pinned, version, _ in pins if pinned == name]
        assert versions, f"{name} is in pyproject.toml but not in the lock: run make lock"
        assert all(v in SpecifierSet(spec) for v in versions), (name, versions, spec)
        assert len(here(name)) == 1, f"{name}: {here(name)} apply here, not one version"


def test_the_lock_has_a_hash_for_every_pin_so_setup_can_require_them():
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", LOCK.read_text().split("\n", 2)[2])
    assert len(blocks) == len(lock_pins()) > 50
    assert all("--hash=sha256:" in block for block in blocks)
    assert "--require-hashes -r $(LOCK)" in (ROOT / "Makefile").read_text()


def test_the_locked_torch_is_the_pinned_one_the_doctor_calls_tested():
    from ddplab import versions

    assert {v for n, v, _ in lock_pins() if n == "torch"} == {versions.LOCKED_TORCH}
    assert {v for n, v, _ in lock_pins() if n == "torchvision"} == {versions.LOCKED_TORCHVISION}
    pinned = (ROOT / "requirements" / "pins.txt").read_text()
    assert f"torch=={versions.LOCKED_TORCH}\n" in pinned
    assert f"torchvision=={versions.LOCKED_TORCHVISION}\n" in pinned
    makefile = (ROOT / "Makefile").read_text()
    floor = re.search(r"^TORCH \?= ([\d.]+)$", makefile, re.M).group(1)
    newest = re.search(r"^NEWEST \?= ([\d.]+)$", makefile, re.M).group(1)
    assert {floor, newest, versions.LOCKED_TORCH} <= set(versions.TESTED)


def test_the_readme_table_names_every_tested_release():
    from ddplab import versions

    section = (ROOT / "README.md").read_text().split("## Torch versions", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+\.\d+\.\d+) ", section, re.M)
    assert sorted(rows) == sorted(versions.TESTED), (rows, sorted(versions.TESTED))


def test_the_doctor_names_an_untested_torch_and_the_command_that_installs_the_tested_set():
    from launch_path import machine_problems

    from ddplab import env, versions

    facts = {"torch": "2.99.0+cu130", "backends": {"gloo": True}, "gpu_count": 0,
             "start_method": "fork"}
    (problem, fix), = machine_problems(env.problems(facts))
    assert "2.99.0" in problem and "2.14.1" in problem
    assert fix.endswith(f"-m pip install -r {versions.LOCK_FILE}")  # a clone has the lock
    facts["torch"] = f"{versions.LOCKED_TORCH}+cpu"
    assert machine_problems(env.problems(facts)) == []
    assert versions.torch_status("2.6.0") and not versions.torch_status("2.7.0")
