"""The repository's benchmarks and evaluations as subcommands of one command line:
``python -m sgl_vtoken_tools <command> [args]`` (``--help`` after a command: its flags and what it
measures). One module per command, each with ``main(argv) -> int``; `COMMANDS` names them. The
modules import their heavy dependencies (torch, transformers, SGLang) inside functions,
so the list and every ``--help`` answer without them.
"""

from __future__ import annotations

# command: (module in this package, one line on what it runs)
COMMANDS: dict[str, tuple[str, str]] = {
    "chat": ("chat", "pass-key chats through the chat API in rounds: answers and speed per cell"),
    "joint": ("joint", "speed and answers in one run: sessions and document questions per cell"),
    "agent": ("agent", "scored agent sessions on SmolLM2: speed, answers, agreement per cell"),
    "ladder": ("ladder", "chat and agent sessions arriving at Poisson rates, load by load"),
    "matrix": ("matrix", "No-Evict vs Naive-Evict vs vToken on the synthetic agent workload"),
    "multiturn": ("multiturn", "SGLang's multi-turn chat benchmark, stock vs streamingllm"),
    "gateway": ("gateway", "SGLang's multi-turn benchmark through smg to evicting replicas"),
    "eviction": ("eviction", "capacity under a small pool, and the plugin's cost when off"),
    "stress": ("stress", "mixed traffic against one server, then crash and leak checks"),
    "quality": ("quality", "answer quality under eviction: fast masked reference, then servers"),
    "recall": ("recall", "multi-turn recall through the host tier on a live server"),
    "kernels": ("kernels", "the Triton kernels against the device's copy bandwidth"),
    "graph-scores": ("graph_scores", "decode scoring captured in a CUDA graph against eager"),
}


def prog(module: str) -> str:
    """``python -m sgl_vtoken_tools NAME`` for the command whose module is `module` (a
    ``__name__``), as its usage line shows it."""
    short = module.rsplit(".", 1)[-1]
    name = next((n for n, (m, _) in COMMANDS.items() if m == short), short)
    return f"python -m sgl_vtoken_tools {name}"
