"""The compiled part of ephost: ephost/ort/libephost_ort.so, the plugin EP library ONNX Runtime loads (ephost.ort),
built from app/ort/shim.c as the package is built, so that an installed wheel needs no compiler. Everything else
is in pyproject.toml."""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

LIBRARY = "ephost.ort.libephost_ort"  # the extension's name; its file is ephost/ort/libephost_ort.so once installed
SOURCE = "app/ort/shim.c"  # its digest goes into the library: app/ort/build.py tells a stale build by it


def python_library() -> str:
    """The shared libpython this interpreter was built with ('' for a static build): the library a host without
    Python loads to run ephost (shim.c embeds it)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return ""
    name = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY") or ""
    path = os.path.join(sysconfig.get_config_var("LIBDIR") or "", name)
    return path if os.path.isfile(path) else name


class BuildShim(build_ext):
    """A plain shared library (no Python module): a fixed file name, and one clear message without a compiler."""

    def get_ext_filename(self, fullname: str) -> str:
        # asked with the full name (where to copy it) and with its last part (where to link it)
        if fullname in (LIBRARY, LIBRARY.rsplit(".", 1)[1]):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext):
        return ext.export_symbols  # not PyInit_*: ONNX Runtime looks up CreateEpFactories and ReleaseEpFactory

    def run(self) -> None:
        compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        if not compiler or shutil.which(compiler[0]) is None:
            raise SystemExit(
                f"ephost: building ephost/ort/libephost_ort.so (ONNX Runtime's plugin EP library) needs a C compiler, "
                f"and {compiler[0] if compiler else 'none'!r} is not on PATH: install one (e.g. `apt-get install gcc`) "
                "or set CC, then install again; an installed wheel needs none")
        super().run()


setup(
    ext_modules=[Extension(
        LIBRARY, sources=[SOURCE], libraries=["dl", "pthread"],
        define_macros=[("EPHOST_PYTHON_LIBRARY", '"' + python_library() + '"'),
                       ("EPHOST_SHIM_DIGEST", '"' + hashlib.sha256(open(SOURCE, "rb").read()).hexdigest()[:16] + '"')],
        extra_compile_args=["-O2", "-fvisibility=hidden"], export_symbols=[])],
    cmdclass={"build_ext": BuildShim},
)
