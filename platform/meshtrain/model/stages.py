"""A pipeline rank's part of the model: the blocks of its stages, the embedding where the first stage is and
the norm with the output head where the last is.

The part is the whole model built on meta and then pruned (:func:`keep_stages`), so every parameter keeps the
name it has in the whole model (blocks are keyed by their index): initialization, which draws each weight
from its name, gives the same values as on one rank, and a checkpoint's names do not depend on the split.
Each stage the rank holds is a :class:`ModelStage`, a view of the part's modules that torch's pipeline stage
runs; the optimizer and the checkpoints see the part.

A stage receives the windows' token ids beside its input (a keyword every stage gets, chunked with the
micro-batches), so it finds the document mask and the RoPE positions itself: nothing but tensors travels
between stages, which the schedules that split the backward need (a block mask is not a tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from meshtrain.model.llama import Transformer


class ModelStage(nn.Module):
    """One pipeline stage of ``model``: its blocks (``layers``, the whole model's indices), after the embedding
    when ``first`` and before the norm and the output head when ``last``. Input: token ids (the first stage) or
    the residual stream; output: the residual stream, or logits (the last stage)."""

    def __init__(self, model: Transformer, index: int, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.index, self.first, self.last = index, first, last
        self.layers = nn.ModuleDict({str(layer): model.layers[str(layer)] for layer in layers})
        if first:
            self.tok_embeddings = model.tok_embeddings
        if last:
            self.norm, self.output = model.norm, model.output
        self._model = (model,)  # not a submodule: the part is registered with the optimizer, not here

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        model = self._model[0]
        h = model.embed(x) if self.first else x
        return model.run_blocks(h, tokens, self.layers.values(), head=self.last)


def keep_stages(model: Transformer, layers: Sequence[range], stage_indices: Sequence[int], num_stages: int
                ) -> list[ModelStage]:
    """Prune ``model`` (on meta) to the stages ``stage_indices`` of ``num_stages``, whose blocks are ``layers``
    (one range per held stage), and return their views, in the order given. An untied model only: the
    config refuses a tied embedding under pipeline parallel (``ParallelConfig.check_model``)."""
    kept = {str(layer) for held in layers for layer in held}
    for key in [key for key in model.layers if key not in kept]:
        model.layers.pop(key)
    if 0 not in stage_indices:
        model.tok_embeddings = None
    if num_stages - 1 not in stage_indices:
        model.norm = model.output = None
    stages = [ModelStage(model, index, held, index == 0, index == num_stages - 1)
              for index, held in zip(stage_indices, layers)]
    model.stages = tuple(stages)
    return stages
