"""transformers' gradient checkpointing under the backend, in one process (the compatibility
subset runs it on the oldest and the newest transformers tested):

- ``lc.hf.compile_blocks`` takes it over (``hf/checkpointing.py``): the blocks that checkpoint
  run a compile with the ``full`` policy, their flags off only while the model runs, the numbers
  one process's; ``parallelize`` picks the policy from the Trainer's arguments;
- compiled by hand where Dynamo cannot trace it (transformers >= 5.25), ``checkpoint_breaks``
  refuses the graph by name under ``hp*cp > 1``, and not once Dynamo is told to trace it.

Across ranks: the Trainer with checkpointing and SFTTrainer's default in
``tests/hf/test_parallelize.py``; by hand at hp=2 x cp=2 in the Inductor trust matrix
(``UNTRACED_CHECKPOINTS``, and the checkpointing cells traced).
"""

from __future__ import annotations

import pytest
import torch

from graph_helpers import StubMesh
from helpers import VOCAB, tiny_llama
from hf_models import dynamo_traces_checkpointing
from trust_cases import Case, case_model

pytestmark = pytest.mark.compat
pytest.importorskip("transformers")


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict]:
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("every_n_layers", [1, 2])
def test_compile_blocks_takes_checkpointing_over_and_is_exact(every_n_layers):
    """A two-layer Llama in float64: every layer checkpointed, or every second (transformers'
    ``every_n_layers``): those run the block compiled with the full policy, the others the plain
    one; loss and gradients equal the eager model's, and the flags are back on after the call."""
    import loong_compile as lc
    from loong_compile.hf.blocks import _BlockForward

    def model():
        built = tiny_llama(hf=True).double()
        built.activation_checkpointing_enable(every_n_layers=every_n_layers)
        return built

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    want = _loss_and_grads(model(), ids)
    compiled = lc.hf.compile_blocks(model(), lowering="aot_eager")
    got = _loss_and_grads(compiled, ids)
    assert abs(got[0] - want[0]) <= 1e-12 * abs(want[0])
    for name, grad in want[1].items():
        assert torch.allclose(got[1][name], grad, rtol=1e-10, atol=1e-12), name
    layers = compiled.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == \
        [i % every_n_layers == 0 for i in range(len(layers))]
    blocks = layers[0].forward
    assert isinstance(blocks, _BlockForward) and blocks.compiled.checkpointed is not None
    assert blocks.compiled.checkpointed is not blocks.compiled.plain   # activations="full"


@pytest.mark.parametrize("arguments, options, policy", [
    ({"activation_checkpointing": True}, {}, "full"),
    ({"activation_checkpointing": True,
      "activation_checkpointing_kwargs": {"offload": True}}, {}, "full_offload"),
    ({"activation_checkpointing": True}, {"activations": "sc++"}, "sc++"),   # the user's policy
    ({}, {}, None),
])
def test_parallelize_takes_the_trainers_checkpointing_as_the_policy(arguments, options, policy,
                                                                    tmp_path):
    from transformers import Trainer, TrainingArguments

    from loong_compile.hf.checkpointing import trainer_policy, with_policy

    trainer = Trainer(model=case_model(Case("llama"), torch.float32), args=TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, **arguments))
    assert with_policy(options, trainer_policy(trainer)).get("activations") == policy


def _refusal_of_a_checkpointed_model(monkeypatch) -> Exception | None:
    """What ``checkpoint_breaks`` says of each graph Dynamo hands over for Llama with
    checkpointing compiled by hand (graph breaks allowed), as for a rank of cp = 2."""
    from loong_compile import LoongConfig
    from loong_compile.passes.base import PassContext
    from loong_compile.passes.safety.checkpoint_breaks import CheckpointBreakPass

    refusals = []

    def backend(gm, example_inputs):
        ctx = PassContext(config=LoongConfig(cp=2), mesh=StubMesh(cp=2), graph_id=0)
        try:
            CheckpointBreakPass().run(gm, ctx)
        except Exception as refused:
            refusals.append(refused)
        return gm.forward

    model = case_model(Case("llama"), torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.zeros(2, 16, dtype=torch.long)
    torch.compile(model, backend=backend)(ids, labels=ids, use_cache=False).loss.backward()
    return refusals[0] if refusals else None


def test_a_model_cut_at_its_checkpointing_is_refused_by_name(monkeypatch):
    from loong_compile.errors import LoongUnsupportedError

    refused = _refusal_of_a_checkpointed_model(monkeypatch)
    if dynamo_traces_checkpointing():   # transformers <= 5.24 without kernels: one graph
        assert refused is None
        return
    assert isinstance(refused, LoongUnsupportedError), refused
    for words in ("LlamaDecoderLayer", "Dynamo broke the graph at torch.utils.checkpoint",
                  "gradient_checkpointing_disable()", "'activations': 'full'", "compile_blocks",
                  "parallelize", "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        assert words in str(refused), words


def test_a_checkpointed_model_dynamo_traces_is_not_refused(monkeypatch):
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        assert _refusal_of_a_checkpointed_model(monkeypatch) is None
