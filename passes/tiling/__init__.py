"""Stage ``dynamo``, last: token tiling -- a token-local computation wider inside than at its
edges runs a tile of tokens at a time, so that only one tile's intermediates exist at once.

Needs: the Dynamo graph after the token-safety stage (which, under ``hp*cp > 1``, proved on the
graph the user wrote that nothing but the exact ops mixes a rank's tokens, and that the loss
is a local sum over a global count).  Two passes, one per strategy of ``ops/tiling``:

- ``lm_head.LMHeadLossPass`` (``lm_head_loss``): the LM head and the token-wise loss after it
  become ``ops.tiling.lm_head.lm_head_loss``, the gradient computed in the forward chunk by
  chunk (the loss is a scalar); logits that leave the graph are reported with their cost.
- ``regions.TokenTilingPass`` (``token_tiling``): each region ``region_find`` finds (the
  closure of one token value, proven token-local by the token analysis, wider inside than at
  its edges: an MLP of any family) becomes ``torch.ops.loong.tiled_region``, each tile
  recomputed in the backward; ``region_graph`` makes the region a module for any tile length.

The tile of both is ``loong_compile/estimate/tiling.py``'s rule.
Leaves: those ops in place of the regions, what it left whole and why in the reports.
"""
