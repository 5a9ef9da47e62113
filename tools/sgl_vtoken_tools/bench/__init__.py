"""Benchmark and stress machinery shared by the commands (`sgl_vtoken_tools.cli`; no sglang
import: servers are reached over HTTP and started through `sgl_vtoken_tools.launcher`).

    server_log     the text an SGLang server logs: decode batches, retractions, failures
    probe          a running server's HTTP endpoints: vToken state, loads, Prometheus counters
    http_client    /generate and streaming chat requests as timed records
    workload       the seeded multi-turn agent workload (sessions, tool outputs, arrivals)
    tokenizer      cutting texts to exact token counts with the server's tokenizer
    agent          one run of the matrix's synthetic agent workload against one server
    agent_summary  the summary line of such a run (latency, concurrency, memory, counters)
    agent_chat     scored agent sessions (quality/agent_sessions.py) played as a chat client
    agent_score    their summaries: throughput, accuracy, agreement with the full cache
    chat_conversations  the pass-key chats: seeded conversations per split, their peak KV
    chat_rounds    pass-key chats through the chat API, in rounds or one at a time, scored
    cell_server    a benchmark cell's server: launched (stock or with the plugin) or running
    quantiles      percentiles and the spread over repeats
    cells          the benchmark matrix's cells and their per-run figures
    matrix         the No-Evict / Naive-Evict / vToken matrix: servers, cells, repeats
    report         the matrix's markdown section; plots: its figures; results_md: writing it
    baseline       SGLang without the plugin, for overhead A/B runs; process CPU time
    load           simple concurrent /generate load; machine load and code provenance
    stress         mixed traffic against one server and the end-of-run leak and crash checks
"""
