"""The forward context keeps each attention backend's per-step data apart."""

import torch
from pagoda.forward_context import AttentionMetadata, prepared_context


class Recording:
    def __init__(self, tag):
        self.tag = tag

    def prepare(self, meta):
        return {"tag": self.tag, "seen": id(meta)}


def meta():
    z = torch.zeros(1, dtype=torch.int32)
    return AttentionMetadata(num_tokens=1, num_seqs=1, num_decodes=1, max_query_len=1, max_seq_len=1,
                             block_size=16, query_start_loc=torch.tensor([0, 1]), seq_lens=z,
                             block_tables=torch.zeros(1, 1, dtype=torch.int32), slot_mapping=z.long(),
                             query_start_loc_cpu=[0, 1], seq_lens_cpu=[1])


def test_each_attention_kind_keeps_its_backends_data():
    ctx = prepared_context(meta(), {"mha": Recording("a"), "mla": Recording("b")})
    assert ctx.metadata_for("mha").backend_data["tag"] == "a"
    assert ctx.metadata_for("mla").backend_data["tag"] == "b"
    assert ctx.metadata_for("mha").slot_mapping is ctx.metadata_for("mla").slot_mapping  # tensors shared


def test_one_backend_prepares_the_step_metadata_itself():
    m = meta()
    ctx = prepared_context(m, {"mha": Recording("a")})
    assert ctx.metadata_for("mha") is m and m.backend_data["tag"] == "a"
