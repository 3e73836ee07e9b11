"""The `mhar` subcommands that are not Trainer methods, each imported only when it runs."""

import importlib

TOOLS: dict[str, tuple[str, str, str]] = {
    "prepare": ("mhar_lightning.data.prepare", "main", "Tokenize text files into checked token shards."),
    "compare": (
        "mhar_lightning.commands.compare",
        "main",
        "Train variants x seeds with `mhar fit`, resumably, and report on them (report.md, plots).",
    ),
    "inspect": (
        "mhar_lightning.commands.inspect",
        "main",
        "Show where each routing site of a checkpoint reads from (depth-attention maps).",
    ),
    "convert-hf": (
        "mhar_lightning.commands.convert",
        "main",
        "Convert a local Hugging Face Llama checkpoint into any residual strategy.",
    ),
    "export-hf": (
        "mhar_lightning.commands.convert",
        "export_main",
        "Export a checkpoint (any strategy but hyper-connections) to a Hugging Face directory.",
    ),
    "consolidate": (
        "mhar_lightning.commands.consolidate",
        "main",
        "Merge a sharded (FSDP) checkpoint into one file.",
    ),
    "generate": ("mhar_lightning.eval.generate", "main", "Continue a prompt with a checkpoint, streamed (KV cache)."),
    "evaluate": (
        "mhar_lightning.eval.evaluate",
        "main",
        "Loss, perplexity and bits per byte of a checkpoint over a prepared split.",
    ),
    "lm-eval": (
        "mhar_lightning.eval.harness",
        "main",
        "Run lm-evaluation-harness tasks on a checkpoint (extra: mhar-lightning[eval]).",
    ),
}
"""Subcommands that are not Trainer methods: name -> (module, function taking argv, help)."""


def run_tool(name: str, argv: list[str]) -> int:
    """Run a non-Trainer subcommand; its module is imported only now, so `mhar --help` never depends on it."""
    module_name, function, _ = TOOLS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise SystemExit(f"mhar {name}: {module_name} is not available in this installation") from error
        raise
    return getattr(module, function)(argv) or 0
