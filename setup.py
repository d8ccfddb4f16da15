"""Builds accordion_hvd and its extension module accordion_hvd._C with CMake and Ninja.

    pip install --no-build-isolation -e .      # what `make setup` does
    pip install --no-build-isolation .         # a torch user's install (README; `make install-check`)
    python setup.py build_ext --inplace         # incremental rebuild (`make build`)

--no-build-isolation matters: the extension must be compiled against the torch that will
import it. Environment knobs: ACCORDION_CUDA=AUTO|ON|OFF (default AUTO: CUDA kernels when
torch has CUDA and nvcc exists), ACCORDION_CUDA_ARCHITECTURES (default "80;90"),
ACCORDION_BUILD_TYPE (default Release).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load_helper(name: str):
    # Load accordion_hvd/<name>.py by path: importing the package needs the extension.
    spec = importlib.util.spec_from_file_location(name, ROOT / "accordion_hvd" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tool(name: str) -> str | None:
    """A build tool from this interpreter's environment first (pip's cmake/ninja), then PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _summarize_failure(log: Path) -> str:
    """One short explanation of a failed CMake/Ninja run instead of the whole log."""
    text = log.read_text(errors="replace")
    if re.search(r"No CMAKE_CXX_COMPILER could be found|CMAKE_CXX_COMPILER.*not.*found", text):
        return "no C++ compiler found: install g++ (apt-get install g++)"
    if "Could not find a package configuration file provided by \"Torch\"" in text:
        return "CMake could not find torch's CMake files: is torch installed in this environment?"
    errors = [line for line in text.splitlines() if re.search(r"error|Error", line)]
    return "\n  ".join(errors[:8]) or "\n  ".join(text.splitlines()[-8:])


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


INSTALL = "pip install setuptools wheel pybind11 cmake ninja && pip install --no-build-isolation ."


def _torch_to_build_against():
    """The torch this environment runs, or exit saying how to install: pip's isolated build
    (a plain `pip install .`) has no torch, or one it fetched itself, not the user's."""
    try:
        import torch
    except ImportError:
        sys.exit(f"error: accordion_hvd's extension is compiled against the torch you run, which pip's isolated "
                 f"build cannot see (or it is not installed: install torch first); install with: {INSTALL}")
    if "pip-build-env" in str(getattr(torch, "__file__", "")):
        sys.exit(f"error: pip's isolated build brought its own torch {torch.__version__}, not the one you run: {INSTALL}")
    return torch


def _version() -> str:
    """0.1.0, or with ACCORDION_WHEEL_TORCH_TAG=1 (`make wheel`) 0.1.0+torch<version>: a
    wheel that says which torch its extension was built against."""
    if os.environ.get("ACCORDION_WHEEL_TORCH_TAG") != "1":
        return "0.1.0"
    import torch
    return "0.1.0+torch" + re.sub(r"[^0-9a-zA-Z.]", ".", torch.__version__)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        torch = _torch_to_build_against()
        import pybind11

        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if not cxx or not shutil.which(cxx):
            sys.exit("error: no C++ compiler found (looked for $CXX, c++, g++): install g++")
        cxx = shutil.which(cxx)
        cuda_host = shutil.which(os.environ.get("CUDAHOSTCXX") or cxx) or cxx
        cmake, ninja = _tool("cmake"), _tool("ninja")
        if not cmake or not ninja:
            sys.exit("error: building accordion_hvd needs cmake and ninja: pip install cmake ninja")

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A fixed build tree per interpreter and torch keeps rebuilds incremental.
        tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
        build_dir = ROOT / "build" / f"cmake-{tag}"
        build_dir.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("ACCORDION_BUILD_TYPE", "Release")
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DCMAKE_CXX_COMPILER={cxx}",
            # The CUDA files' host code is compiled by the same compiler unless the user asks
            # otherwise (CUDAHOSTCXX): one C++ toolchain for every object in _C.
            f"-DCMAKE_CUDA_HOST_COMPILER={cuda_host}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path};{pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DACCORDION_CUDA={os.environ.get('ACCORDION_CUDA', 'AUTO')}",
            f"-DACCORDION_CUDA_ARCHITECTURES={os.environ.get('ACCORDION_CUDA_ARCHITECTURES', '80;90')}",
            f"-DACCORDION_TORCH_HAS_CUDA={'ON' if torch.version.cuda else 'OFF'}",
            f"-DACCORDION_TORCH_VERSION={torch.__version__}",
            f"-DACCORDION_SOURCE_HASH={_load_helper('_source_hash').source_hash(ROOT)}",
            f"-DACCORDION_OUTPUT_DIR={out_dir}",
        ]
        jobs = os.environ.get("ACCORDION_BUILD_JOBS", str(os.cpu_count() or 1))
        self._run("configure", configure, build_dir)
        self._run("build", [cmake, "--build", str(build_dir), "--parallel", jobs], build_dir)
        self._check_errors_raise(out_dir, cxx, cuda_host)

    @staticmethod
    def _check_errors_raise(out_dir: Path, cxx: str, cuda_host: str) -> None:
        """Refuse a build whose C++ errors crash the process (accordion_hvd/_build_check.py)."""
        library = max(out_dir.glob("_C*.so"), key=lambda p: p.stat().st_mtime)
        why = _load_helper("_build_check").errors_raise(str(library))
        if why:
            library.unlink()  # an import then says "not built" instead of crashing later
            sys.exit(f"error: the built accordion_hvd._C cannot raise an error: {why}. It was compiled by "
                     f"{cxx} (CUDA host code: {cuda_host}). Seen with a compiler wrapper set in CXX and "
                     f"CUDAHOSTCXX; rebuild with the system compiler, e.g. CXX=/usr/bin/g++ "
                     f"CUDAHOSTCXX=/usr/bin/g++ (make build)")

    def _run(self, step: str, cmd: list[str], build_dir: Path) -> None:
        log = build_dir / f"{step}.log"
        print(f"[accordion_hvd] cmake {step} (log: {log})", flush=True)
        with open(log, "w") as fh:
            result = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        if result.returncode != 0:
            sys.exit(f"error: CMake {step} of accordion_hvd._C failed:\n  {_summarize_failure(log)}\n"
                     f"full log: {log}")


setup(
    name="accordion-hvd",
    version=_version(),
    description="Adaptive gradient compression (Accordion: PowerSGD, TopK) for Horovod and PyTorch",
    packages=find_packages(include=["accordion_hvd", "accordion_hvd.*"]),
    ext_modules=[CMakeExtension("accordion_hvd._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    zip_safe=False,
)
