"""Test-side models of what the server does around the kernels, shared by test folders
(`from helpers.reference import ...`; `tests` is on pytest's pythonpath, pyproject.toml).

    reference       pure-torch oracles: a repack plan applied to fake buffers, attention over a row
    row             RequestRow, the CPU model of one request's row (appends, evictions, reclaim)
    step_ref        the per-row eviction path, oracle of the batched step `sgl_vtoken.step`
    dispatch_count  what runtime code asks of the device (syncs, launches, allocations), on CPU
    fake_pool       SGLang's allocator, slot table, request and batch, faked
    fake_server     a scheduler's share of SGLang around the real `patches/` code, at any size
    step_counts     one decode step at the trigger on `fake_server`, its device work counted

They import the runtime alone (no `sgl_vtoken_tools`); no command imports them.
"""
