"""The training step ``parallelize`` puts into a ``transformers.Trainer``: data by replica, the
batch cut over the sequence's ranks, the loss in the compiled graph, gradients over the mesh.

``LoongTrainerMixin`` goes first in the trainer's class (``parallelize`` swaps the instance's
class for ``type("Loong" + name, (LoongTrainerMixin, cls), {})``), so every other method, a
subclass's (``trl.SFTTrainer``'s dataset preparation, logging, model card) included, stays as
it was.  What it changes, and why:

* **Data**: Accelerate deals batches to every process; ``_deal_by_replica`` makes its sampler
  deal them to the ``dp`` replicas instead, so the ``hp·cp`` ranks of a sequence get one batch.
  Step and epoch counts are then those of one process with ``dp`` replicas.
* **No DistributedDataParallel**: DDP around a compiled model makes Dynamo's DDPOptimizer split
  the graph at bucket boundaries (pieces without attention, which the backend refuses), and
  DDP averages over every rank where a sequence's ranks must sum.  ``parallelize`` marks the
  model as prepared, so Accelerate leaves it unwrapped, and ``training_step`` reduces the
  gradients itself (``loong_compile.reduce_gradients``: summed over a sequence's ranks,
  averaged over replicas) after the backward of the last micro-batch of an accumulation
  window, before the Trainer clips them: every rank then clips the full gradient by its norm.
* **Loss**: each rank's compiled step returns its share, the sum of its tokens' losses over
  ``N``, the number of labels of the accumulation window (``get_batch_samples``); with
  ``average_tokens_across_devices`` (the default) ``N`` counts every replica's labels and the
  backward scales the share by ``dp`` (the mean over replicas is then their sum), without it
  each replica's own (a mean of the replicas' losses, as DDP gives).
* **Logged loss**: ``training_step`` returns the share times the number of ranks that hold
  part of ``N`` (``dp·hp·cp`` or ``hp·cp``): the Trainer's mean over all processes is then
  the window's loss, one process's.
* **Evaluation**: ``prediction_step`` sums the ranks' shares (one all-reduce) into the batch's
  loss, on every rank; ``evaluation_loop``'s gather repeats it for the ``dp`` replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loong_compile._compat.dynamo import forward_hooks_named, recompile_limit_raises
from loong_compile.errors import LoongConfigError, LoongShapeError
from loong_compile.hf.batches import count_labels, cut_batch
from loong_compile.hf.checkpointing import taken_over
from loong_compile.parallel.gradients import reduce_gradients


class CausalLMLoss(torch.nn.Module):
    """The model and its loss, returning only the loss: the graph ``torch.compile`` gets, so
    the backend chunks the LM head with the loss (returned logits could not be chunked).
    ``shift_labels=labels``: ``shard_batch`` already shifted them over the whole sequence."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor,
                num_items_in_batch: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids,
                          attention_mask=attention_mask, labels=labels, shift_labels=labels,
                          num_items_in_batch=num_items_in_batch, use_cache=False).loss


@dataclass
class LoongState:
    """What ``parallelize`` set up, on the trainer as ``trainer._loong``."""

    mesh: Any                      # loong_compile.parallel.mesh.LoongMesh
    step: torch.nn.Module          # torch.compile(CausalLMLoss(model), backend="loong", ...)
    pad_token_id: int
    pad_to_multiple_of: int | None
    tokens_across_replicas: bool   # TrainingArguments.average_tokens_across_devices
    masked_length: int | None = None   # the one row length of batches with a mask or documents

    @property
    def loss_ranks(self) -> int:
        """Ranks whose shares add up to one loss: all of them when N counts every replica."""
        return self.mesh.world if self.tokens_across_replicas else self.mesh.sp


class LoongTrainerMixin:
    """Overrides of ``transformers.Trainer`` methods (module docstring); ``self._loong`` is the
    ``LoongState``."""

    _loong: LoongState

    # ---- data: one batch per replica ----------------------------------------------------

    def get_train_dataloader(self):
        return _deal_by_replica(super().get_train_dataloader(), self._loong.mesh)

    def get_eval_dataloader(self, eval_dataset=None):
        return _deal_by_replica(super().get_eval_dataloader(eval_dataset), self._loong.mesh)

    def get_test_dataloader(self, test_dataset):
        return _deal_by_replica(super().get_test_dataloader(test_dataset), self._loong.mesh)

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self._loong.mesh.dp

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The window's micro-batches and ``N``, their labels' count (as the Trainer counts
        ``num_items_in_batch``), over every replica when tokens are averaged across them."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        return batches, self._count_labels(batches, device)

    def _count_labels(self, batches: list, device: torch.device) -> torch.Tensor:
        count = sum(count_labels(b) for b in batches).to(device)
        mesh = self._loong.mesh
        if self._loong.tokens_across_replicas and mesh.dp > 1:
            dist.all_reduce(count)          # every rank adds its replica's count: hp*cp copies each
            count = count // mesh.sp
        return count

    # ---- the step ---------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of the loss: its tokens' summed loss over ``num_items_in_batch``
        (by default, the labels of this batch, counted as ``get_batch_samples`` counts them)."""
        if return_outputs:
            raise LoongConfigError("compute_loss(return_outputs=True)", "the compiled step "
                                   "returns the loss only (a rank holds its tokens' logits only)",
                                   "ask for the loss alone")
        state = self._loong
        _drop_input_grad_hooks(self.model)
        if num_items_in_batch is None:
            num_items_in_batch = self._count_labels([inputs], inputs["labels"].device)
        batch = cut_batch(inputs, state.mesh, pad_token_id=state.pad_token_id,
                          pad_to_multiple_of=state.pad_to_multiple_of)
        masked = batch.attention_mask is not None or "position_ids" in inputs
        if masked and state.mesh.sp > 1:
            self._check_one_length(batch.input_ids.size(1) * state.mesh.sp)
        extra = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask}
        # mixed precision, as Accelerate would wrap the forward; and a frame past Dynamo's
        # recompile limit raises rather than run uncompiled on this rank's tokens alone
        # transformers' checkpointing (the Trainer turns it on when training starts) is the
        # step's activation policy (parallelize chose it): the layers' flags off for the call
        with self.accelerator.autocast(), recompile_limit_raises(), taken_over(self.model):
            return state.step(batch.input_ids, batch.position_ids, batch.labels,
                              num_items_in_batch.to(batch.input_ids.device), **extra)

    def _check_one_length(self, length: int) -> None:
        """A second length would make Dynamo compile the sequence length dynamic, and the
        backend proves a mask (padding, documents) for one shape: say so before it refuses."""
        state = self._loong
        if state.masked_length is None:
            state.masked_length = length
        elif length != state.masked_length:
            raise LoongShapeError(
                f"a batch of {length} tokens per row (padded) after batches of "
                f"{state.masked_length}, with padding or packed documents",
                "rows with an attention mask or packed documents are compiled for one length "
                "(the backend proves the mask they make for one shape)",
                "pad every batch to one length: parallelize(..., pad_to_multiple_of=L) with L "
                "the longest row (per_device batch x max_length for TRL's packing), or the "
                "collator's padding='max_length' / SFTConfig(pad_to_multiple_of=L); eval rows too")

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        state = self._loong
        self.model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            share = self.compute_loss(self.model, inputs, num_items_in_batch=num_items_in_batch)
        # N counting every replica's labels: the gradient is the replicas' sum, and
        # reduce_gradients averages over them
        scale = state.mesh.dp if state.tokens_across_replicas else 1
        self.accelerator.backward(share * scale)
        if self.accelerator.sync_gradients:     # the window's last micro-batch: before clipping
            reduce_gradients(self.model, state.mesh)
        return share.detach() * state.loss_ranks

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The batch's loss (every rank's share summed), on every rank; no logits."""
        if not prediction_loss_only:
            raise LoongConfigError(
                "prediction_loss_only=False (predict(), or compute_metrics)", "not yet supported: "
                "a rank holds its tokens' logits only, and the compiled step returns the loss",
                "evaluate() without compute_metrics, or TrainingArguments(prediction_loss_only=True)")
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            share = self.compute_loss(self.model, inputs)
        loss = share.detach().float()
        if self._loong.mesh.world > 1:
            if not self._loong.tokens_across_replicas:
                loss = loss / self._loong.mesh.dp   # the replicas' mean
            dist.all_reduce(loss)
        return loss, None, None

    def evaluation_loop(self, *args, **kwargs):
        # the loop gathers each batch's repeated loss from every process; ours holds the same
        # value on every rank: one copy per replica, as many as one process's batch would hold
        self.gather_function = self._gather_replicas
        return super().evaluation_loop(*args, **kwargs)

    def _gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = tensor.repeat(self._loong.mesh.dp)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:   # as gather_for_metrics drops
            gathered = gathered[:state.remainder]             # the last batch's refills
        return gathered


# the hook's function in transformers (enable_input_require_grads) and in PEFT (its fallback)
_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def _drop_input_grad_hooks(model: torch.nn.Module) -> None:
    """transformers' gradient checkpointing hooks the input embeddings to make their output
    require grad (``enable_input_require_grads``), which only reentrant checkpointing needs (it
    computes no gradient for a segment none of whose inputs requires grad, as under PEFT's
    frozen embeddings).  The step takes checkpointing over (``checkpointing.taken_over``: no
    ``torch.utils.checkpoint`` runs), so the hook changes no gradient; but Dynamo breaks the
    graph at its ``requires_grad_()`` (on a frozen embedding's output, and before torch 2.13
    always), and the embedding would be a graph of its own, without attention, which the backend
    refuses.  Every such hook is removed (TRL and the Trainer each install one, the Trainer when
    training starts, after ``parallelize``)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(embeddings, torch.nn.Module):
        forward_hooks_named(embeddings, _GRAD_HOOKS, remove=True)


def _deal_by_replica(loader, mesh):
    """Make Accelerate's sampler deal batches to ``mesh.dp`` replicas (the Trainer itself
    adjusts ``BatchSamplerShard`` this way for its rank-aware samplers)."""
    if mesh.world == 1:
        return loader
    from accelerate.data_loader import BatchSamplerShard

    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, BatchSamplerShard):
        raise LoongConfigError(
            f"a data loader whose batches Accelerate deals with {type(sampler).__name__}",
            "the ranks of one sequence must get the same batch: parallelize deals the batches "
            "of Accelerate's BatchSamplerShard (a map-style dataset) by replica",
            "use a map-style dataset and Accelerate's default data loader settings")
    sampler.num_processes, sampler.process_index = mesh.dp, mesh.dp_rank
    return loader
