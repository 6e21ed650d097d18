"""Installs oumi_megatron.pth next to the package so Oumi is hooked lazily at interpreter start.

The .pth line only registers an import hook (no oumi/torch import), so plain Python and plain Oumi
start-up stay unchanged; see src/oumi_megatron/_oumi_hook.py.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "oumi_megatron.pth"
PTH_LINE = "import oumi_megatron._oumi_hook as _h; _h.install()\n"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, PTH_NAME)
        with open(target, "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


class EditableWheelWithPth(editable_wheel):
    # `pip install -e .` builds an "editable wheel" whose root is written from this folder;
    # setuptools puts its own namespace .pth files there the same way.
    def _install_namespaces(self, installation_dir: str, pth_prefix: str) -> None:
        super()._install_namespaces(installation_dir, pth_prefix)
        with open(os.path.join(installation_dir, PTH_NAME), "w") as f:
            f.write(PTH_LINE)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
