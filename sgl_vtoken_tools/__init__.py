"""sgl-vtoken's tooling: what scripts and tests use around the plugin, never the server.

The runtime is `sgl_vtoken` (with `sgl_vtoken.kernels` and `sgl_vtoken.patches`); nothing in it
imports this package.

    kernel_bench       timers, move patterns and floors of `scripts/bench_kernels.py`
    kernel_bench_runs  that script's workloads, one function per part
"""
