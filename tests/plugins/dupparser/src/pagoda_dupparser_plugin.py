"""A test plugin that registers a second tool parser called "hermes"."""

from pagoda import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("hermes", "pagoda_dupparser_plugin:MyHermes")
