"""A STAND-IN for NVIDIA Apex, used only by raysgd-amp's tests.

NVIDIA Apex cannot be installed here (it is not on PyPI, needs a CUDA build, and `apex.amp` left it
after 25.04), so `tests/amp` puts this package on `sys.path` in place of it. Only `apex.amp` exists.
"""
