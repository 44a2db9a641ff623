"""Entry point (group ``pagoda``): the architecture name -> the model class, as a lazy string so
that discovering the plugin imports nothing heavy."""

from pagoda import hookimpl


@hookimpl
def register_models(register):
    register("GraniteForCausalLM", "pagoda_granite.model:GraniteForCausalLM")

