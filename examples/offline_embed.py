"""Embeddings and reranking offline with a pooling model (docs/pooling.md).

    python examples/offline_embed.py path/to/Qwen3-Embedding-0.6B [path/to/reranker]
"""

import sys

from pagoda import LLM
from pagoda.pooling import PoolingParams


def main() -> None:
    docs = ["A pagoda is a tiered tower with multiple eaves.", "Ramen is a noodle soup."]
    embedder = LLM(sys.argv[1], runner="pooling")
    for doc, out in zip(docs, embedder.embed(docs, PoolingParams(dimensions=32))):
        print(f"{doc[:30]!r}: {len(out.outputs.embedding)} dims, first {out.outputs.embedding[:3]}")
    ranker = LLM(sys.argv[2], runner="pooling") if len(sys.argv) > 2 else embedder
    for doc, out in zip(docs, ranker.score("What is a pagoda?", docs)):
        print(f"score {out.outputs.score:.4f}  {doc}")


if __name__ == "__main__":
    main()
