"""The wheel carries csrc/: build it from the working tree, install it non-editable into a temporary
folder, and import it from a clean interpreter that cannot see the source tree (`python -I -S`, cwd
elsewhere, no PYTHONPATH, no .pth files, so no editable install either).  There the CUDA sources
must resolve to files inside the installed package, and `hf_megatron.kernels.compile_check` must
hand exactly those files to its compilers (stand-in nvcc / c++ that record their arguments, so the
test takes seconds; the real compile is `python -m hf_megatron.kernels.compile_check`).  About 5 s."""
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREE = ("pyproject.toml", "README.md", "hf_megatron", "csrc")  # what the build reads


def _setuptools_version() -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ()


pytestmark = [pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="needs pip"),
              pytest.mark.skipif(_setuptools_version() < (70, 1),  # the build runs without isolation
                                 reason="needs setuptools>=70.1 (the [test] extra installs it)")]

CHECK = r"""
import json, os, sys
site_dir, site_packages, expected = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path[:0] = [site_dir]
sys.path += site_packages            # torch & co., without running their .pth files
import hf_megatron                    # no CUDA here (CUDA_VISIBLE_DEVICES is empty)
from hf_megatron.kernels import build, compile_check
package = os.path.join(site_dir, "hf_megatron")
assert hf_megatron.__file__.startswith(package + os.sep), hf_megatron.__file__
assert str(build.CSRC) == os.path.join(package, "csrc"), build.CSRC
found = sorted(p.name for p in build.CSRC.iterdir())
assert found == expected, (found, expected)
assert all(p.is_file() and p.parent == build.CSRC for p in build.source_files())
assert compile_check.compile_all() == 0   # the stand-in compilers on PATH record what they get
"""

FAKE_COMPILER = """#!/bin/sh
printf '%s\\n' "$@" >> "$COMPILER_LOG"
"""


def _run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel of the working tree, built from a copy (the build writes build/ and *.egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in TREE:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tmp / "src" / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (tmp / "src").mkdir(exist_ok=True)
            shutil.copy2(source, tmp / "src" / name)
    _run([sys.executable, "-m", "pip", "wheel", str(tmp / "src"), "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(tmp / "dist")])
    (built,) = (tmp / "dist").glob("hf_megatron-*.whl")
    return built


def test_wheel_ships_csrc_inside_the_package_and_every_subpackage(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"hf_megatron"}, top_level
    shipped = sorted(Path(n).name for n in names if n.startswith("hf_megatron/csrc/"))
    assert shipped == sorted(p.name for p in (REPO / "csrc").iterdir() if p.is_file())
    packages = {str(p.parent.relative_to(REPO)) for p in (REPO / "hf_megatron").rglob("*.py")
                if "__pycache__" not in p.parts}
    missing = sorted(p for p in packages if not any(n.startswith(p + "/") for n in names))
    assert not missing, f"not in the wheel: {missing}"


def test_installed_wheel_finds_its_csrc_without_the_source_tree(wheel, tmp_path):
    site_dir, elsewhere, bin_dir = tmp_path / "site", tmp_path / "cwd", tmp_path / "bin"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site_dir),
          str(wheel)])
    elsewhere.mkdir()
    bin_dir.mkdir()
    for compiler in ("nvcc", "c++"):
        (bin_dir / compiler).write_text(FAKE_COMPILER)
        (bin_dir / compiler).chmod(0o755)
    log = tmp_path / "compiler.log"
    paths = sysconfig.get_paths()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "",
           "COMPILER_LOG": str(log)}
    expected = sorted(p.name for p in (REPO / "csrc").iterdir() if p.is_file())
    _run([sys.executable, "-I", "-S", "-c", CHECK, str(site_dir),
          json.dumps(sorted({paths["purelib"], paths["platlib"]})), json.dumps(expected)], cwd=elsewhere, env=env)

    compiled = sorted(Path(a) for a in log.read_text().split("\n") if a.endswith((".cu", ".cpp")))
    installed = site_dir / "hf_megatron" / "csrc"
    assert compiled == sorted(installed / p.name for p in (REPO / "csrc").iterdir() if p.suffix in (".cu", ".cpp"))
