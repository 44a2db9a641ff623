"""Benchmarks behind ``pagoda bench``: each module adds one ``pagoda bench <name>`` subcommand."""
