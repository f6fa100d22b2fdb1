"""Build hook: the patch series under ``patches/<framework>/`` (series.toml and its
``git format-patch`` files) travel in the wheel as ``modal_rl/patch_series/<framework>/``,
so the launchers that apply them work from an installed wheel; a checkout (editable install)
reads ``patches/`` itself (``modal_rl.package_data``). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SERIES_FILES = ("series.toml", "*.patch")


class BuildPyWithSeries(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads patches/ from the checkout
        source = Path(__file__).resolve().parent / "patches"
        target = Path(self.build_lib) / "modal_rl" / "patch_series"
        for series in sorted(source.glob("*/series.toml")):
            out = target / series.parent.name
            out.mkdir(parents=True, exist_ok=True)
            for pattern in SERIES_FILES:
                for path in sorted(series.parent.glob(pattern)):
                    shutil.copyfile(path, out / path.name)


setup(cmdclass={"build_py": BuildPyWithSeries})
