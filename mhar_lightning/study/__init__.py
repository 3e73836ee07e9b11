"""`mhar compare`'s study runner: a grid of `mhar fit` runs, their results read back from their logs, the report."""
