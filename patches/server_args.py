"""Command-line flags of sgl-vtoken and how their values reach every SGLang process.

The flags are added to SGLang's own parser (AFTER `ServerArgs.add_cli_args`), so they show in
`--help` and argparse rejects bad choices before any model loads. `ServerArgs.from_cli_args`
keeps declared fields only, so the values are read from the parsed namespace (AFTER
`from_cli_args`) and published as JSON in the environment variable `SGL_VTOKEN_CONFIG`:
scheduler and detokenizer processes are spawned by the launcher and inherit it. The same JSON
also rides on the server args as `_vtoken_config` (underscore attributes survive pickling).
Python `Engine(...)` users set `SGL_VTOKEN_CONFIG` themselves.
"""

import argparse
import json
import os

ENV_VAR = "SGL_VTOKEN_CONFIG"

# Policies the server can run today; the library knows more than the server serves.
KV_EVICT_CHOICES = ("none",)


def add_cli_args(result, parser: argparse.ArgumentParser):
    """AFTER `ServerArgs.add_cli_args(parser)` (a staticmethod)."""
    group = parser.add_argument_group("sgl-vtoken (token-level KV eviction)")
    group.add_argument(
        "--kv-evict", type=str, default="none", choices=KV_EVICT_CHOICES,
        help="Token eviction policy applied to every request's KV cache ('none' = stock SGLang).",
    )


def settings_from_namespace(args: argparse.Namespace) -> dict:
    """The plugin's settings as a JSON-ready dict, from a parsed SGLang namespace."""
    return {"policy": getattr(args, "kv_evict", "none")}


def from_cli_args(result, cls, args: argparse.Namespace):
    """AFTER `ServerArgs.from_cli_args(args)` (a classmethod): publish the settings."""
    settings = settings_from_namespace(args)
    os.environ[ENV_VAR] = json.dumps(settings, sort_keys=True)
    result._vtoken_config = settings
    return result


def current_settings() -> dict:
    """The settings of this process, as published by the launcher (defaults if none)."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return {"policy": "none"}
    try:
        settings = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_VAR} is not valid JSON: {e}") from None
    if settings.get("policy") not in KV_EVICT_CHOICES:
        raise ValueError(f"{ENV_VAR}: policy must be one of {list(KV_EVICT_CHOICES)}, got {settings.get('policy')!r}")
    return settings
