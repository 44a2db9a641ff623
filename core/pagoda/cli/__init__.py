"""The ``pagoda`` command line."""
