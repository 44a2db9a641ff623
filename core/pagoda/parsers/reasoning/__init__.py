"""The built-in reasoning parsers (registered in ``pagoda.builtin_plugin``)."""
