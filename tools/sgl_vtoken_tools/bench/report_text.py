"""The prose of the agent benchmark's section: provenance, setup, what each column isolates
(with the run's own fairness checks) and how the figures are measured, each computed from the
run's settings and checks. What the figures mean is written by hand in
docs/results/agent-benchmark.md, after the generated section, never in this template."""

from __future__ import annotations

from sgl_vtoken_tools.bench.cells import MODE_NAMES
from sgl_vtoken_tools.bench.checks import fair


def provenance(meta: dict) -> str:
    return (
        f"Regenerate with `make bench` (`python -m sgl_vtoken_tools matrix`; this run: `{meta['command']}`, "
        f"{meta['date']}, {meta['elapsed_min']:.1f} min on {meta['machine']}; load average "
        f"{meta['load_start']} at the start and {meta['load_end']} at the end: other jobs share these "
        "cores, so absolute latencies are noisy; the spread over repeats shows how much). Raw JSON lines "
        f"of this run: [`{meta['jsonl']}`]({meta['jsonl_link']}); "
        "`python -m sgl_vtoken_tools matrix --render-only` redraws this section and its plots from them."
    )


def setup(meta: dict) -> str:
    a = meta["settings"]
    if a["quick"]:
        return (
            f"**Quick smoke run.** Model `{meta['model']}`, pool {a['pool']}, {a['sessions']} sessions x "
            f"{a['turns']} turns, replies of {a['reply_tokens']} tokens, burst runs only, "
            f"{a['repeats']} repeats."
        )
    return (
        f"**Setup.** Model `{meta['model']}`; KV pool `--max-total-tokens {a['pool']}` on every "
        f"server; eviction interval {a['interval']}, sinks {a['sink']}. Workload "
        f"(`tools/sgl_vtoken_tools/bench/workload.py`, seed {a['seed']}): {a['sessions']} agent sessions x {a['turns']} "
        f"turns of streaming chat completions; a system prompt shared by all sessions (instructions, "
        f"a JSON tool schema and filler: {meta['system_prompt_tokens']} tokens, `--system-tokens "
        f"{a['system_tokens']}` or the schema's length if longer); turn 1 a user task (median "
        f"{a['user_tokens']} tokens), later turns a tool output (lognormal, median {a['tool_tokens']}, "
        f"{a['tool_min']}..{a['tool_max']} tokens); every reply exactly {a['reply_tokens']} tokens (greedy, "
        f"`ignore_eos`); every request re-sends the whole history; turn t of session i is request "
        f"id `<run>-s<i>-t<t>` in every mode. Servers: {meta['servers']}. Runs per cell and repeat: a "
        f"burst (all sessions at t = 0; the tables and plots below unless said otherwise), an unloaded "
        f"baseline ({a['baseline_sessions']} sessions one at a time) and a Poisson rate ladder "
        f"({', '.join(f'{r:g}' for r in sorted(a['rates']))} sessions/s). {a['repeats']} repeats, the "
        "cells interleaved within each repeat (order reversed every other repeat), so that the modes "
        "compared see the same drift in machine load."
    )


def _check_line(c: dict) -> str:
    na, vt = c["cached"]
    text = (
        f"{c['policy']}, budget {c['budget']}, page {c['page']}: outputs identical in {c['identical']} of "
        f"{c['requests']} request pairs ({c['same_rids']} sent with the same id"
        + (f", {c['unpaired']} unpaired: failed or missing on one side" if c["unpaired"] else "")
        + f"), evicted tokens equal in {c['evicted_equal']} of {c['runs']} runs, "
        f"cached prompt tokens {na} (Naive-Evict) vs {vt} (vToken)"
    )
    if c["first_difference"]:
        d = c["first_difference"]
        text += (
            f"; first differing output: request `{d['rid']}` (repeat {d['repeat']}, run {d['run']}), so "
            "the later turns of that session were different requests"
        )
    rc = c.get("repeat_consistency")
    if rc:
        text += (
            "; outputs the same in every repeat for "
            + ", ".join(f"{same} of {n} {MODE_NAMES[m]}" for m, (same, n) in rc.items())
            + " requests"
        )
    if na != vt:
        text += (
            "; **prompt caching differs**, so in these two columns TTFT, throughput and concurrency "
            "also carry the cost of the prompt tokens one mode prefills again (retained pages do not)"
        )
    return "- " + text + "."


def isolation(checks: list[dict]) -> str:
    verdict = (
        "all checks pass"
        if checks and all(fair(c) and c["cached"][0] == c["cached"][1] for c in checks)
        else "see the caveats below"
    )
    return "\n".join(
        [
            "**What each column isolates.** Every mode plays the same workload with the same request ids. "
            "*No-Evict -> Naive-Evict* isolates eviction without reclamation: the same requests keep at most "
            "the budget of live tokens (Naive-Evict) or everything (No-Evict), but an evicted token's page "
            "returns to the pool only once every token on it is dead. *Naive-Evict -> vToken* isolates "
            "reclamation when both evict the same victims (a seeded policy seeds them from the request id), "
            "return the same outputs and cache the same prompt tokens: then only what happens to the freed "
            "slots differs (vToken compacts the survivors into dense pages and frees the rest). Whether this "
            f"run met those conditions, checked request by request and run by run ({verdict}):",
            "",
        ]
        + [_check_line(c) for c in checks]
    )


def measuring(meta: dict) -> str:
    interval = meta["settings"]["sample_interval"]
    return (
        "**How it is measured.** Peak running requests: the largest `Decode batch, #running-req` the server "
        "logged during the run (`--decode-log-interval 1`: every decode step). Mean running requests, KV "
        f"pages and retained pages come from samples every {interval:g} s while requests run: "
        "*KV pages in use per running request* = pool tokens in use (`/v1/loads`: total - available - "
        "radix-evictable, so a shared prefix counts once and a prompt being prefilled counts whole) / page "
        "size / running requests, every mode; *retained pages per request* = the plugin's `retained_pages` "
        "gauge (pages of the last decode step's evicting requests after its eviction, naive held-back "
        "pages included; `/server_info`) / that step's request count (its `live_tokens` // budget: each "
        "request past its first eviction keeps between budget and budget + interval tokens), the paper's "
        "metric, evicting modes only. Throughput under SLA: the highest ladder rate whose p95 TTFT (and "
        "every lower rate's) stays within the factor x the same repeat's unloaded p95 TTFT; 1.05 is the "
        "vToken paper's factor, the looser one absorbs the noise of a shared CPU. Retractions: delta of "
        "`sglang:num_retracted_requests_total`. Evicted tokens, pages freed, tokens moved: deltas of the "
        "plugin's counters. Outputs are compared by a digest of each reply (`output_hash` in the request "
        'lines). The No-Evict cells send `kv_evict: {"policy": "none"}` (stock SGLang code paths, '
        "radix prefix reuse included). Every figure is the median over the repeats, with the smallest "
        "and largest value in parentheses when they differ."
    )
