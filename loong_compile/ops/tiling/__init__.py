"""Token tiling: a token-local computation run a tile of tokens at a time, so that only one
tile's intermediates exist at once.  One mechanism (the tile loop and the gradients gathered
over it, ``loop``), two strategies:

==============  ======================================================================
``region``      recompute in the backward, for a region whose outputs are per token (an
                MLP of any family): the forward saves only the region's inputs, the
                backward runs each tile again and writes its slice of the input's gradient;
                the weights' gradients are summed over the tiles.  The region is compiled
                once for a tile shape and called in a loop.
``lm_head``     gradient in the forward, for a region that ends in a sum to a scalar (the
                LM head and its loss): each tile's gradient is computed with its value, and
                the backward only scales them (docs/architecture.md, "The LM head and the
                loss", says why this and not recomputing: a 4th matmul over the head).
==============  ======================================================================

The tile each uses is ``loong_compile/estimate/tiling.py``'s rule (``estimate/lm_head.py`` for
the head); the passes that emit them are ``passes/tiling/``.
"""
