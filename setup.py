"""Build hook: a wheel carries `lua/` and `alembic/` inside the package, as `app/lua` and
`app/alembic`, where `app.data_path` finds them through importlib.resources.

They stay at the repository root, where they are edited and reviewed; an editable install
reads them there (see `app.data_path`). Everything else is declared in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("lua", "alembic")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the checkout's own files are read in place
            return
        for name in SHIPPED:
            # A file deleted here must not ship from an earlier build left in build/.
            shutil.rmtree(Path(self.build_lib, "app", name), ignore_errors=True)
            for src in sorted(Path(name).rglob("*")):
                if src.is_file() and "__pycache__" not in src.parts:
                    dest = Path(self.build_lib, "app", src)
                    self.mkpath(str(dest.parent))
                    self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPy})
