"""The optional compiled speedups (pulsectl/_speedups.c and the parts it includes from
pulsectl/csrc); everything else is in pyproject.toml.

The extension is optional: without a C compiler the install still succeeds and pulsectl runs
its numpy code paths, which give the same bytes, only slower.
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pulsectl._speedups",
            ["pulsectl/_speedups.c"],
            depends=sorted(glob("pulsectl/csrc/*.c")),  # its parts, #included in order
            extra_compile_args=["-O3", "-std=c99", "-Wall", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
