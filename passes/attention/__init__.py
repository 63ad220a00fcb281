"""Stage ``dynamo``, first: find every attention call, prove its mask, rewrite it to 2D-Attention.

``eager_attention`` runs first (under ``hp·cp > 1``): attention written as ops (transformers'
eager chain, gpt-oss's sinks) becomes an SDPA call (``ops.attention.sinks.sdpa_with_sinks`` with sinks),
or is refused naming the step SDPA cannot express (a softcap, a score bias, a live dropout).

Needs: the Dynamo FX graph (torch IR, ``nn_module_stack`` and sources on every node) and the
module being compiled (``model_facts``: windows and RoPE decided from the sequence length).
Leaves: every attention call replaced by ``loong_compile.ops.attention_2d`` with its mask as
document ids / padding / window (fact ``attention_sites``), for the token-safety stage to trust.

``attention_2d`` is the pass, in three rooms: the call it reads (``calls``; ``flash_match``:
flash-attn calls as Dynamo traces them), the mask it proves (``mask_policy``: the window, the
chunk and the document ids; ``mask_proof``: what a mask means, by running its subgraph;
``input_roles``: which graph inputs are the positions and the attention mask, by how they
flow, fact ``position_inputs`` for the backend's input check; ``document_ids``: the
document-id graph a proven mask becomes; ``model_facts``: what the module declares) and what
it writes (``emission``: casts, the GQA repeats removed by ``kv_repeat``, transposes, the
call).  ``made_positions`` is the
second pass (under ``hp·cp > 1``): an ``arange`` of the rank's tokens that RoPE or a position
embedding reads becomes the layout's positions (fact ``made_positions``).
"""
