"""Your model: any nn.Module whose constructor takes ``num_classes`` (ftjob passes it)."""

from __future__ import annotations

from torch import nn


class TinyConvNet(nn.Module):
    def __init__(self, num_classes: int, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, hidden, 5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv2d(hidden, hidden, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.net(x)
