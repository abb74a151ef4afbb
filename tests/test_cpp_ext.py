"""The C++ kernels' build (engines/cpu/cpp_ext.py, engines/cpu/kernels.py): one module binds every kernel, a
built module is imported straight from its build directory, and an unfinished build is never imported."""

from __future__ import annotations

import os
import shutil

import pytest

from engines.cpu import cpp_ext, fused_decode, kernels, paged_kernel, panel_kernel


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this host")
def test_one_module_binds_every_kernel_and_loads_without_the_builder():
    """Where a compiler exists the module builds (the kernels' own tests skip when it does not, so a header
    or binding mistake would otherwise pass unnoticed), every wrapper returns that one module, and a second
    process finds it by name alone (load_built: no ninja run, no lock)."""
    mod, why = kernels.load()
    assert mod is not None, why
    assert panel_kernel.load()[0] is mod and paged_kernel.load()[0] is mod and fused_decode.load()[0] is mod
    again = cpp_ext.load_built(cpp_ext.build_name("shardserve_cpu_", kernels.combined_source()))
    assert again is not None
    for f in kernels.FUNCTIONS:
        assert callable(getattr(again, f)), f


def test_an_unfinished_or_locked_build_is_not_imported():
    """A library without ninja's log line for its link (a build cut off mid-way) or a build directory
    someone holds the lock of is left to torch's builder (None here)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = f"shardserve_test_{os.getpid()}"
    d = _get_build_directory(name, verbose=False)
    try:
        open(os.path.join(d, f"{name}.so"), "wb").close()  # a truncated library
        assert cpp_ext.load_built(name) is None  # no .ninja_log
        with open(os.path.join(d, ".ninja_log"), "w") as f:
            f.write("# ninja log v5\n0\t10\t1\tmain.o\tabc\n")  # compiled, never linked
        assert cpp_ext.load_built(name) is None
        with open(os.path.join(d, ".ninja_log"), "a") as f:
            f.write(f"10\t20\t2\t{name}.so\tdef\n")
        open(os.path.join(d, "lock"), "w").close()
        assert cpp_ext.load_built(name) is None  # someone is building it
        os.remove(os.path.join(d, "lock"))
        assert cpp_ext.load_built(name) is None  # logged, but not a library: the import fails, the builder runs
    finally:
        shutil.rmtree(d, ignore_errors=True)
