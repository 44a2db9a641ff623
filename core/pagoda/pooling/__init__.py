"""Pooling models: embeddings, rerank/score and classification on the engine's paged prefill path.

``runner: pooling`` makes an ``LLMEngine`` prefill-only (``pagoda.pooling.engine``): each prompt is
computed in chunks, its hidden states (after the final norm, before the LM head) are pooled as the
chunks pass (``pagoda.pooling.poolers``), an optional score head turns the pooled vector into
scores (``pagoda.pooling.heads``), and the prompt's KV blocks are freed at once. docs/pooling.md.
"""

from pagoda.pooling.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooling.params import PoolingParams

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput"]
