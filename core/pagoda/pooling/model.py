"""A registered decoder as a pooling model.

``XForSequenceClassification`` checkpoints (transformers' rerankers and classifiers: the decoder as
``model.*`` plus a ``score`` linear [num_labels, hidden]) load into the registered ``XForCausalLM``
class with a ``score`` head added. Checkpoints of a bare decoder (``layers.*``, ``embed_tokens.*``,
``norm.*``: sentence-transformers' Qwen3-Embedding) get the ``model.`` prefix back. The LM head
is only needed when ``classifier_from_token`` reads its rows; otherwise a checkpoint may lack it.
"""

from __future__ import annotations

from torch import nn

from pagoda.loader.weights import WeightStream

CLASSIFIER_SUFFIX = "ForSequenceClassification"
BARE_DECODER_PARTS = ("layers", "embed_tokens", "norm")


def is_sequence_classifier(hf_config) -> bool:
    return any(a.endswith(CLASSIFIER_SUFFIX) for a in getattr(hf_config, "architectures", None) or [])


def pooling_architectures(architectures: list[str]) -> list[str]:
    """Each ``XForSequenceClassification`` (and bare decoder ``XModel``, as AutoModel saves it) preceded
    by ``XForCausalLM``, the class that builds it."""
    found = []
    for arch in architectures:
        if arch.endswith(CLASSIFIER_SUFFIX):
            found.append(arch[: -len(CLASSIFIER_SUFFIX)] + "ForCausalLM")
        elif arch.endswith("Model") and not arch.endswith("PreTrainedModel"):
            found.append(arch[: -len("Model")] + "ForCausalLM")
        found.append(arch)
    return found


def as_pooling_model(cls: type, hf_config, config) -> type:
    """A subclass of the decoder class ``cls`` that loads pooling checkpoints (see the module doc)."""
    classifier = is_sequence_classifier(hf_config)
    needs_lm_head = bool(config.classifier_from_token)

    class PoolingModel(cls):
        def __init__(self, hf_config, quant_config=None, prefix: str = ""):
            super().__init__(hf_config, quant_config=quant_config, prefix=prefix)
            if classifier:  # transformers' score head: no bias, one row per label
                self.score = nn.Linear(hf_config.hidden_size, int(getattr(hf_config, "num_labels", 1) or 1),
                                       bias=False)

        def load_weights(self, weights) -> set[str]:
            found: dict = {}

            def renamed(sources: dict):
                for name, tensor in _items(weights, sources):
                    if classifier and name == "score.weight":
                        found[name] = tensor
                        continue
                    if name.split(".", 1)[0] in BARE_DECODER_PARTS:
                        name = "model." + name
                    yield name, tensor

            loaded = set(super().load_weights(WeightStream(renamed)))
            if classifier:
                if "score.weight" not in found:
                    from pagoda.errors import ModelLoadError

                    raise ModelLoadError(f"{type(self).__name__}: the {CLASSIFIER_SUFFIX} checkpoint has no "
                                         f"'score.weight'")
                self.score.weight.data.copy_(found["score.weight"])
                loaded.add("score.weight")
            if not needs_lm_head:  # pooling never reads the LM head: a checkpoint may lack it
                loaded.update(n for n, _ in self.named_parameters() if n.startswith("lm_head."))
            return loaded

    PoolingModel.__name__ = PoolingModel.__qualname__ = f"{cls.__name__}Pooling"
    return PoolingModel


def _items(weights, sources: dict):
    make = getattr(weights, "_make", None)
    return make(sources) if make is not None else iter(weights)
