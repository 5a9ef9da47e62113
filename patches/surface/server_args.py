"""Command-line flags of sgl-vtoken and how their values reach every SGLang process.

The flags are added to SGLang's own parser (AFTER `ServerArgs.add_cli_args`), so they show in
`--help` and argparse rejects bad choices before any model loads. `ServerArgs.from_cli_args`
keeps declared fields only, so the values are read from the parsed namespace (AFTER
`from_cli_args`), validated into an `EvictConfig` together with the SGLang settings they depend
on, and published as JSON in the environment variable `VTOKEN_CONFIG`, the one way they cross
processes: scheduler and detokenizer processes are spawned by the launcher and inherit it.
Python `Engine(...)` users set `VTOKEN_CONFIG` themselves. Any invalid value or combination
exits the launcher with status 2 and a message that names the flag.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from typing import TYPE_CHECKING, NoReturn

from sgl_vtoken.config import (
    ENV_VAR,
    RECLAIM_MODES,
    TRIGGERS,
    EvictConfig,
    flag_of,
    policy_from_config,
    setting_keys,
)
from sgl_vtoken.policies import POLICIES

from ..cache import radix
from ..core import contract
from ..core.model_support import peak_problem, server_model_config, unsupported_model_reason
from ..step.prefill import prefill_chunk_problem

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# Statistics the server collects for policies (`EvictionPolicy.needs`): cached keys, and
# attention probabilities recomputed next to each attention layer (`scores.py`).
SERVED_NEEDS = {"keys", "attn"}
# Every registered policy whose statistics the server collects, in registry order.
KV_EVICT_CHOICES = ("none", *(n for n, cls in POLICIES.items() if set(cls.needs) <= SERVED_NEEDS))
# Settings that are the server's, not the policy's, inside --kv-evict-config (flat keys).
SERVER_PARAMS = setting_keys(json=True)

# (server-args attribute, predicate of an unsupported value, flag, why) checked with eviction on.
UNSUPPORTED = (
    ("enable_mixed_chunk", bool, "--enable-mixed-chunk", "mixed batches bypass the eviction hook"),
    (
        "speculative_algorithm",
        lambda v: v is not None,
        "--speculative-algorithm",
        "speculative decoding is not supported with eviction",
    ),
    ("attn_dp_size", lambda v: (v or 1) > 1, "--attn-dp-size", "DP attention is not supported"),
    ("enable_dp_attention", bool, "--enable-dp-attention", "DP attention is not supported"),
    ("pp_size", lambda v: (v or 1) > 1, "--pp-size", "pipeline parallelism is not supported"),
    (
        "dcp_size",
        lambda v: (v or 1) > 1,
        "--dcp-size",
        "decode context parallelism is not supported",
    ),
    (
        "disaggregation_mode",
        lambda v: v not in (None, "null"),
        "--disaggregation-mode",
        "PD disaggregation is not supported",
    ),
    ("enable_hierarchical_cache", bool, "--enable-hierarchical-cache", "HiCache is not supported"),
    ("enable_lmcache", bool, "--enable-lmcache", "LMCache is not supported"),
    (
        "enable_two_batch_overlap",
        bool,
        "--enable-two-batch-overlap",
        "two-batch overlap is not supported",
    ),
    (
        "enable_streaming_session",
        bool,
        "--enable-streaming-session",
        "streaming sessions are not supported",
    ),
    ("enable_hisparse", bool, "--enable-hisparse", "HiSparse is not supported"),
)


def add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER `ServerArgs.add_cli_args(parser)` (a staticmethod)."""
    g = parser.add_argument_group("sgl-vtoken (token-level KV eviction)")
    g.add_argument(
        "--kv-evict",
        type=str,
        default="none",
        choices=KV_EVICT_CHOICES,
        help="Token eviction policy applied to every request's KV ('none' = stock SGLang).",
    )
    g.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        help="Live KV tokens a request keeps after each eviction (required with --kv-evict).",
    )
    g.add_argument(
        "--kv-sink",
        type=int,
        default=4,
        help="Attention-sink tokens always kept (rounded up to whole pages). Default 4.",
    )
    g.add_argument(
        "--kv-window", type=int, default=0, help="Most recent tokens always kept. Default 0."
    )
    g.add_argument(
        "--kv-evict-interval",
        type=int,
        default=1,
        help="Evict when a row reaches budget + interval tokens (1 = every step). Default 1.",
    )
    g.add_argument(
        "--kv-evict-trigger",
        type=str,
        default="budget",
        choices=TRIGGERS,
        help="'budget': evict a row whenever it reaches budget + interval tokens; 'pressure': "
        "only when the KV pool cannot hold what the running requests and the requests waiting "
        "for a place in the batch need, the longest rows down to one level, no further than "
        "the shortage needs and never below the budget; with room to spare every row keeps "
        "all its tokens. Default budget.",
    )
    g.add_argument(
        "--kv-reclaim",
        type=str,
        default="vtoken",
        choices=RECLAIM_MODES,
        help="'vtoken': compact survivors and free pages; 'naive': free a page only when "
        "all its tokens are dead (the Naive-Evict baseline). Default vtoken.",
    )
    g.add_argument(
        "--kv-evict-config",
        type=str,
        default=None,
        help="JSON object of policy parameters, e.g. '{\"seed\": 1}', "
        '\'{"aggregation": "max"}\', \'{"history": 16}\' (scissorhands), '
        '\'{"obs_window": 32, "score_layers": [0, 1]}\' (attention policies; score_layers '
        '"upper" by default: the upper half of the model\'s layers; "all"), '
        "'{\"reuse_history\": false}' (no compacted-history reuse across turns), "
        "'{\"prefill_chunk\": 256}' (evict during prefill, every 256 prompt tokens), "
        '\'{"offload": true, "host_tokens": 65536, "recall": 32}\' (evicted KV to a '
        "host store, recalled by later turns and, with prefill_chunk, by the prompt's last chunk).",
    )


def unsupported_reason(args: object) -> tuple[str, str] | None:
    """(flag, why) of the first SGLang setting eviction cannot run with, or None."""
    for attr, bad, flag, why in UNSUPPORTED:
        if hasattr(args, attr) and bad(getattr(args, attr)):
            return flag, why
    return None


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"sglang serve: error: {message}\n")
    raise SystemExit(2)


def config_from_namespace(args: argparse.Namespace) -> EvictConfig:
    """The validated `EvictConfig` of a parsed SGLang namespace; exits naming the flag if
    invalid."""
    policy = getattr(args, "kv_evict", "none")
    params: dict = {}
    if args.kv_evict_config:
        try:
            params = json.loads(args.kv_evict_config)
        except json.JSONDecodeError as e:
            _fail(f"argument --kv-evict-config: not valid JSON ({e})")
        if not isinstance(params, dict):
            _fail("argument --kv-evict-config: must be a JSON object")
    top = {k: params.pop(k) for k in SERVER_PARAMS if k in params}
    flags = dict(
        budget=args.kv_budget,
        sink=args.kv_sink,
        window=args.kv_window,
        interval=args.kv_evict_interval,
        trigger=getattr(args, "kv_evict_trigger", "budget"),
        reclaim=args.kv_reclaim,
        page_size=getattr(args, "page_size", None) or 1,
    )
    if policy == "none":
        if params or top:
            _fail("argument --kv-evict-config: needs --kv-evict other than 'none'")
        # No eviction by default; the other flags are the defaults of per-request `kv_evict`.
        try:
            return EvictConfig(**flags)
        except ValueError as e:
            _fail_naming_flag(e)
    problem = unsupported_reason(args)
    if problem:
        _fail(f"argument {problem[0]}: cannot be combined with --kv-evict {policy}: {problem[1]}")
    if args.kv_budget is None:
        _fail(f"argument --kv-budget: required with --kv-evict {policy}")
    try:
        cfg = EvictConfig.from_dict(dict(policy=policy, **flags, params=params, **top))
        policy_from_config(cfg)  # the policy's parameters: validated once, here
    except ValueError as e:
        _fail_naming_flag(e)
    if cfg.prefill.chunk is not None:
        chunk_problem = prefill_chunk_problem(
            getattr(args, "chunked_prefill_size", None),
            getattr(args, "disable_overlap_schedule", False),
        )
        if chunk_problem:
            _fail(f"argument --kv-evict-config: {chunk_problem}")
    chunked = getattr(args, "chunked_prefill_size", None)
    if cfg.host.recall and chunked is not None and chunked <= 0:
        _fail(
            f"argument --kv-evict-config: recall {cfg.host.recall} needs SGLang's chunked prefill "
            "(--chunked-prefill-size > 0): a recalling turn's prefill is cut in two"
        )
    return cfg


def _fail_naming_flag(e: ValueError) -> NoReturn:
    """Exit naming the flag that sets the `EvictConfig.<key>` an error names."""
    m = re.search(r"EvictConfig\.(\w+)", str(e))
    _fail(f"argument {flag_of(m.group(1)) if m else '--kv-evict'}: {e}")


def check_model_supported(cfg: EvictConfig, server_args: ServerArgs) -> None:
    """With a server policy: exit 2 before weights load if the served model cannot be evicted,
    or the settings do not fit it (budget over the context length or the pool, score_layers
    outside its layers)."""
    path = getattr(server_args, "model_path", None)
    try:
        model_config = server_model_config(server_args)
    except Exception as e:  # no config, no eviction: refuse rather than guess
        _fail(
            f"argument --kv-evict: cannot read the config of --model-path {path!r} to check that "
            f"{cfg.policy} can serve it ({type(e).__name__}: {e})"
        )
    reason = unsupported_model_reason(model_config)
    if reason:
        _fail(f"argument --kv-evict: {cfg.policy} cannot serve --model-path {path!r}: {reason}")
    problem = settings_problem(
        cfg,
        model_config.context_len,
        model_config.num_hidden_layers,
        getattr(server_args, "max_total_tokens", None),
    )
    if problem:
        _fail(problem)


def settings_problem(
    cfg: EvictConfig,
    context_len: int,
    num_layers: int,
    pool_tokens: int | None,
    budget_name: str = "argument --kv-budget",
) -> str:
    """Why `cfg` cannot run on this model and pool ("" when it can)."""
    if cfg.row_budget > context_len:
        return (
            f"{budget_name}: must be <= the model's context length {context_len} (got {cfg.budget})"
        )
    if pool_tokens is not None and (problem := peak_problem(cfg, pool_tokens, budget_name)):
        return problem
    if (
        pool_tokens is not None
        and cfg.prefill.chunk
        and (hold := cfg.prefill_hold) is not None
        and hold > pool_tokens
    ):
        return (
            f"argument --kv-evict-config: prefill_chunk {cfg.prefill.chunk}: a prefill evicting "
            f"request holds up to budget + prefill_chunk + recall + page_size = "
            f"{cfg.prefill_hold} KV tokens, more than the pool's {pool_tokens}"
        )
    layers = cfg.scoring.layer_ids(num_layers)
    if layers is not None and max(layers) >= num_layers:
        return (
            f"argument --kv-evict-config: score_layers {list(layers)} must be layer ids "
            f"< {num_layers} (the model's layers)"
        )
    return ""


def select_radix_backend(server_args: ServerArgs, cfg: EvictConfig) -> None:
    """The holed radix cache (`radix.py`) serves prompt sharing under eviction and history
    reuse: chosen automatically with a server policy, refused explicitly where it cannot run."""
    backend = getattr(server_args, "radix_cache_backend", None)
    if backend == radix.NAME:
        if getattr(server_args, "disable_radix_cache", False):
            _fail(
                f"argument --radix-cache-backend: {radix.NAME} cannot run with "
                "--disable-radix-cache"
            )
    elif backend is None and cfg.enabled and not getattr(server_args, "disable_radix_cache", False):
        server_args.radix_cache_backend = radix.NAME


def from_cli_args(result: ServerArgs, cls: type, args: argparse.Namespace) -> ServerArgs:
    """AFTER `ServerArgs.from_cli_args(args)` (a classmethod): validate and publish the settings."""
    cfg = config_from_namespace(args)
    if cfg.enabled:
        check_model_supported(cfg, result)
        if cfg.span and getattr(result, "skip_tokenizer_init", False):
            _fail(f"argument --kv-evict-config: {SPAN_NEEDS_TOKENIZER.format(span=cfg.span)}")
    select_radix_backend(result, cfg)
    missing = contract.check_hooks_applied()
    if missing and cfg.enabled:
        _fail(
            f"--kv-evict {cfg.policy}: sgl-vtoken hooks are not in place ({'; '.join(missing)}); "
            "refusing to serve stock SGLang under an eviction flag"
        )
    os.environ[ENV_VAR] = cfg.to_json()  # the one way the settings reach SGLang's processes
    return result


SPAN_NEEDS_TOKENIZER = (
    "span {span} (span-aware keeping, the attention policies' default) reads words from the "
    'tokenizer, which --skip-tokenizer-init leaves unloaded: set "span": 0 or load the tokenizer'
)


def refusal(server_args: ServerArgs) -> str:
    """Why per-request `kv_evict` must be refused on a server with `server_args` ("" if not).
    Asked by the tokenizer manager, in the launcher's process, from its own server args."""
    missing = contract.check_hooks_applied()
    problem = unsupported_reason(server_args)
    if missing:
        return f"hooks not in place: {'; '.join(missing)}"
    return f"the server runs with {problem[0]} ({problem[1]})" if problem else ""


@functools.cache
def server_config() -> EvictConfig:
    """This process's eviction settings, as the launcher published them (`from_cli_args`)."""
    return EvictConfig.from_env()
