"""Registers every SGLang hook of sgl-vtoken. Runs in the launcher and in every SGLang process."""

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from . import cpu, server_args

# (target, hook, type): the whole splice, in one table. `contract.py` checks each target exists.
HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", server_args.add_cli_args, HookType.AFTER),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", server_args.from_cli_args, HookType.AFTER),
    ("sglang.srt.managers.scheduler.Scheduler.__init__", cpu.before_scheduler_init, HookType.BEFORE),
)

_registered = False


def register() -> None:
    """Register the hooks once per process; SGLang applies them right after plugins load."""
    global _registered
    if _registered:
        return
    _registered = True
    for target, hook, hook_type in HOOKS:
        HookRegistry.register(target, hook, hook_type)
