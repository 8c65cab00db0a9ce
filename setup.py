"""Ships the course (notebooks/ and exercises/) inside the wheel as ``ddplab/_course``.

The files live once in git, at the top of the repository. A wheel build copies them into the
package, so ``ddplab init`` can write them into a learner's folder; an editable install
(``make setup``) needs no copy: ``ddplab.workspace`` finds them beside the package.
Everything else about the package is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# The notebooks' pattern is ddplab.workspace.NOTEBOOK_GLOB (03_ddp_spawn, 03b_ddp_internals, ...).
COURSE = {"notebooks": "[0-9][0-9]*_*.ipynb", "exercises": "*.py"}


class build_py_with_course(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, pattern in COURSE.items():
            target = Path(self.build_lib, "ddplab", "_course", folder)
            target.mkdir(parents=True, exist_ok=True)
            for path in sorted((HERE / folder).glob(pattern)):
                shutil.copyfile(path, target / path.name)


setup(cmdclass={"build_py": build_py_with_course})
