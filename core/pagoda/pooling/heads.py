"""Score heads: pooled hidden states [B, H] -> per-label logits [B, L].

Two kinds: the ``score`` linear of an ``XForSequenceClassification`` checkpoint, and the LM head's
logits of a few tokens (``classifier_from_token``, Qwen3-Reranker style: with [no, yes] the single
logit is logit(yes) - logit(no), so sigmoid of it is the softmax probability of "yes" over the two).
"""

from __future__ import annotations

import torch

from pagoda.errors import ConfigError


class ScoreHead:
    def __init__(self, num_labels: int, describe: str):
        self.num_labels = num_labels
        self.describe = describe

    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def activate(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities: sigmoid for one label, softmax over several."""
        return torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)


class LinearScoreHead(ScoreHead):
    def __init__(self, score: torch.nn.Linear):
        super().__init__(score.weight.shape[0], f"score head of {score.weight.shape[0]} label(s)")
        self.score = score

    def logits(self, pooled):
        return self.score(pooled.to(self.score.weight.dtype)).float()


class TokenScoreHead(ScoreHead):
    def __init__(self, model, token_ids: list[int], tokens: list[str]):
        super().__init__(1, f"LM-head logits of {tokens} (classifier_from_token)")
        self.model = model
        self.token_ids = token_ids

    def logits(self, pooled):
        dtype = next(self.model.parameters()).dtype
        vocab = self.model.compute_logits(pooled.to(dtype)).float()[:, self.token_ids]
        return vocab[:, -1:] - vocab[:, :1] if len(self.token_ids) == 2 else vocab


def build_score_head(model, tokenizer, classifier_from_token: list[str] | None) -> ScoreHead | None:
    if classifier_from_token:
        if tokenizer is None:
            raise ConfigError("classifier_from_token needs the model's tokenizer (skip_tokenizer_init is set)")
        ids = []
        for token in classifier_from_token:
            found = tokenizer.convert_tokens_to_ids(token)
            if found is None or (found == tokenizer.unk_token_id and token != tokenizer.unk_token):
                ids_of_text = tokenizer.encode(token, add_special_tokens=False)
                if len(ids_of_text) != 1:
                    raise ConfigError(f"classifier_from_token: {token!r} is not one token of this tokenizer "
                                      f"(it encodes to {ids_of_text})")
                found = ids_of_text[0]
            ids.append(int(found))
        return TokenScoreHead(model, ids, list(classifier_from_token))
    score = getattr(model, "score", None)
    if isinstance(score, torch.nn.Linear):
        return LinearScoreHead(score)
    return None
