"""pagoda-models: model architectures registered through pagoda's ``register_models`` hook."""

__version__ = "0.1.0"
