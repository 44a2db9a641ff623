"""The transformers fallback: any causal LM that transformers implements and pagoda does not,
run through transformers' own modeling code on pagoda's paged KV cache, scheduler and sampler.

- ``support``: which architectures it can run, and why not the others;
- ``attention``: the attention function registered in transformers' ``AttentionInterface``
  that sends every attention call to the layer's paged ``pagoda.layers.Attention``;
- ``parallel``: transformers' linears and embeddings swapped for pagoda's (quantizable, and
  split over the ranks by the model's ``base_model_tp_plan``);
- ``weights``: checkpoint tensors to parameters, through transformers' own key conversions;
- ``model``: ``TransformersForCausalLM``, the model class the core registers as ``"*"``.
"""
