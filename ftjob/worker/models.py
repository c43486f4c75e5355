"""Models: a small CNN for quick CPU jobs; torchvision's ResNets come straight from config
(``_target_: torchvision.models.resnet50``). Any ``_target_`` that accepts ``num_classes``
works; the runner passes the dataset's class count."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head; fast enough for CPU jobs on small images.

    Short jobs take few, large steps, so BatchNorm's running statistics use a high momentum
    (0.5 rather than torch's 0.1) to keep up with the weights: validation then tracks
    training from the first epoch instead of lagging a whole epoch behind."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        width: int = 32,
        dropout: float = 0.0,
        bn_momentum: float = 0.5,
    ) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.BatchNorm2d(cout, momentum=bn_momentum),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(
            block(in_channels, width),
            nn.MaxPool2d(2),
            block(width, 2 * width),
            nn.MaxPool2d(2),
            block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * width, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(node: dict[str, Any], num_classes: int) -> nn.Module:
    """Instantiate ``model._target_`` with the dataset's ``num_classes``."""
    from hydra.utils import instantiate

    model = instantiate(node, num_classes=num_classes, _convert_="all")
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model._target_={node.get('_target_')!r} built a {type(model).__name__}, not a torch.nn.Module"
        )
    return model
