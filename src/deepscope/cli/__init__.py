"""The `deepscope` command line."""
