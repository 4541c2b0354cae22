"""setuptools build step (pyproject's cmdclass): the top-level csrc/ goes into the wheel as hf_megatron/csrc/.

csrc/ stays at the repository's top level (the product card's layout); kernels/build.py finds it
inside the installed package.  `[tool.setuptools.packages.find]` only discovers folders under
hf_megatron/, and an explicit package list would silently leave out every new subpackage, so this
step adds the one package whose folder lies elsewhere; which files it carries is pyproject's
`[tool.setuptools.package-data]`.  Loaded by setuptools from its file at build time (it imports
neither torch nor hf_megatron); nothing is compiled here: the extension is built on first use.
"""
from setuptools.command.build_py import build_py

CSRC_PACKAGE = "hf_megatron.csrc"
CSRC_FOLDER = "csrc"


class BuildPyWithCsrc(build_py):
    def finalize_options(self) -> None:
        super().finalize_options()
        if CSRC_PACKAGE not in self.packages:
            self.packages = [*self.packages, CSRC_PACKAGE]
        self.package_dir.setdefault(CSRC_PACKAGE, CSRC_FOLDER)
