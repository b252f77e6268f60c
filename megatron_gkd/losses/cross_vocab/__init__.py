"""The cross-tokenizer loss: a teacher of another tokenizer distilled through a sparse map ``W`` from the student's
vocabulary to the teacher's (``q = softmax(z) @ W``), vocab-parallel over the student's logit shards.

- :mod:`.loss`: the loss on the teacher's top-k (the definitions, the plan of a batch, the unfused entry point);
- :mod:`.fused`: the same with the output layer recomputed in token chunks (no ``[N, V/tp]`` logits kept);
- :mod:`.hidden`: against the teacher's whole distribution from its hidden states (``hidden_support=full``);
- :mod:`.heavy`: teacher ids with a large fan-in projected densely; :mod:`.kernels`: numba host kernels over the
  map's entries; :mod:`.projection_map`: the map's shard on a rank (CSR by teacher id).

``megatron_gkd.losses`` exports the three entry points.
"""
