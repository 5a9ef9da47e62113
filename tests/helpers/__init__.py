"""Test-side models of what the server does around the kernels, shared by test folders
(`from helpers.reference import ...`; `tests` is on pytest's pythonpath, pyproject.toml).

    reference   pure-torch oracles: a repack plan applied to fake buffers, attention over a row
    row         RequestRow, the CPU model of one request's row (appends, evictions, reclaim)

They import the runtime and `sgl_vtoken_tools.step_ref` (the per-row path, which the
`evict-step` command also runs); no command imports them.
"""
