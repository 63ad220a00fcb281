"""FX facts every stage of the passes shares; the stage folders import them from here (never
from each other), and nothing here imports a stage folder.

==================  ==========================================================================
module              what it answers
==================  ==========================================================================
``nodes``           one node read without running it: its value, an argument, its op's name
``op_sets``         op-name sets (casts, views, matmuls, losses, angles), defined once
``walks``           what a value comes from or only goes to; the backward's nodes; graph order
``tokens``          the tokens per rank of a Dynamo graph; whether an axis holds tokens
``subgraphs``       the graph and the higher-order-op bodies a dynamo pass walks
``module_paths``    a node's source line; its module path parsed and followed to the module
                    (attributes, PEFT's ``__dict__['_modules']``, items); the layer it belongs to
``batch_view``      whether a graph receives anything of the batch (token ids, positions it
                    makes, a proven mask's documents)
``emit``            adding a call with its fake value and its source metadata
``autocast``        the dtype autocast casts to at each node
``aten_ops``        attention, collective and random ops of AOTAutograd's graphs; FLOPs
``storage``         views, the node owning a value's storage, its bytes
``token_analysis``  which nodes act on each token alone, and why the others do not (the
                    token-safety and tiling stages read it); ``token_ops`` the rule each op
                    falls under, ``row_permutation`` a sort of the rows proven undone (an
                    expert dispatch), ``row_ops`` the ops that treat every row alike
==================  ==========================================================================
"""
