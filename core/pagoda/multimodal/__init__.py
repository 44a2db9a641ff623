"""Images in: decoding and hashing images (``media``), a request's images placed in its prompt
(``inputs``), the engine's preprocessing with the model's processor (``processor``), the runner's
encoder step and encoder-output cache (``encoder``), fetching image URLs for the server (``fetch``).
The model side of the contract is ``pagoda.interfaces.SupportsMultiModal``."""

from pagoda.multimodal.inputs import MultiModalInputs, PlacedImage

__all__ = ["MultiModalInputs", "PlacedImage"]
