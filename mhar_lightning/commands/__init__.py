"""The `mhar` tools that are not Trainer methods, one module per command, each a `main(argv)` that `cli.TOOLS` names."""
