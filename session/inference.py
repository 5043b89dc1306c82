"""InferenceSession: run a graph forward (PopART's InferenceSession)."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch

from session.lowering import LoweredGraph
from session.model_io import ModelLike, load_model
from session.options import SessionOptions


def to_feeds(batch: Mapping[str, Any], names, device: torch.device) -> dict[str, torch.Tensor]:
    """numpy arrays or tensors → tensors on the device, for the graph inputs named."""
    feeds = {}
    for name in names:
        if name not in batch:
            raise ValueError(f"the batch has no {name!r}; the graph takes {list(names)}")
        value = batch[name]
        feeds[name] = (value if torch.is_tensor(value) else torch.from_numpy(np.asarray(value))).to(device)
    return feeds


class InferenceSession:
    def __init__(self, model: ModelLike, options: Optional[SessionOptions] = None):
        self.options = options or SessionOptions()
        self.device = torch.device(self.options.device)
        self.graph = LoweredGraph(load_model(model)).to(self.device).eval()

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.graph.input_names

    @torch.no_grad()
    def run(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Outputs by name, as tensors on the session's device."""
        feeds = to_feeds(batch, self.graph.input_names, self.device)
        with self.options.autocast():
            return self.graph(feeds)
