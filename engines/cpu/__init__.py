"""CPU speed machinery: C++ kernels (csrc/*.cpp, built once per machine by cpp_ext.py), the panel
linear that replaces nn.Linear, the paged-attention kernel, the fused decode step, OpenMP thread choice
and host-memory probes. Every kernel picks its variant at run time from the CPU's flags."""
