"""The built-in tool-call parsers, one format per module (registered in
``pagoda.builtin_plugin``)."""
