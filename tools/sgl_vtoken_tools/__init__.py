"""sgl-vtoken's tooling: the benchmarks and what tests use around the plugin, never the server.

The runtime is `sgl_vtoken` (with `sgl_vtoken.kernels` and `sgl_vtoken.patches`); nothing in it
imports this package (`tests/test_layout.py`). Each is its own distribution: `sgl-vtoken` (the
repository's pyproject.toml) and this one, `sgl-vtoken-tools` (tools/pyproject.toml).

    cli/               the benchmarks and evaluations: `python -m sgl_vtoken_tools <command>`
    bench/             benchmark and stress machinery the commands are built on
    quality/           answer quality under eviction: tasks, fast masked reference, server check
    launcher           start and stop an SGLang server in a child process
    tiny_model         the embedded tiny Llama (`python -m sgl_vtoken_tools.tiny_model DIR`)
    models             real models built offline (`python -m sgl_vtoken_tools.models smollm2 DIR`)
    hf_reference       Hugging Face oracle: greedy decoding with the server's evictions as a mask
    kernel_bench       timers, move patterns and floors of `python -m sgl_vtoken_tools kernels`
    kernel_bench_runs  that script's workloads, one function per part
"""
