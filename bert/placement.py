"""Where each part of the model runs: the one place that applies placement scopes.

PopART's BERT put the word embedding, the tied MLM projection and the heads on IPU 0
and spread the encoder layers over IPUs by `layers_per_ipu`, one pipeline stage per
group of layers, with a recompute checkpoint after every layer. Here, with
`layers_per_stage = (n0, n1, ...)`:

- embeddings: virtual graph 0, pipeline stage 0;
- layer i: virtual graph s and pipeline stage s of the group s that holds it; its nodes
  are marked Recompute and its output passes through a Checkpoint Identity;
- heads (and losses): virtual graph 0 again, in a pipeline stage of their own after
  the last layer group (stage = number of groups) so stages follow the data flow;
  with a single group everything is stage 0.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from bert.config import ModelConfig
from builder import Builder, RecomputeType, Tensor


class Placement:
    def __init__(self, b: Builder, cfg: ModelConfig):
        self._b = b
        stages = cfg.stages
        self._stage_of_layer = [s for s, n in enumerate(stages) for _ in range(n)]
        self.heads_stage = len(stages) if len(stages) > 1 else 0

    @contextlib.contextmanager
    def _at(self, virtual_graph: int, stage: int, recompute: RecomputeType) -> Iterator[None]:
        b = self._b
        with b.virtual_graph(virtual_graph), b.pipeline_stage(stage), b.recompute(recompute):
            yield

    def embeddings(self):
        return self._at(0, 0, RecomputeType.UNDEFINED)

    def layer(self, i: int):
        s = self._stage_of_layer[i]
        return self._at(s, s, RecomputeType.RECOMPUTE)

    def heads(self):
        return self._at(0, self.heads_stage, RecomputeType.UNDEFINED)

    def checkpoint(self, x: Tensor) -> Tensor:
        """Keep this layer output in the forward pass; everything before it is recomputed."""
        with self._b.recompute(RecomputeType.CHECKPOINT):
            return self._b.onnx.Identity(x)

