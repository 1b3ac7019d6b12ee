"""Object detection with torchvision's interface: list batches, a dict of losses, predictions in evaluation.

The detector follows torchvision's detection models (Faster R-CNN, RetinaNet, FCOS, SSD): it is called
as `model(images, targets)` while training and returns a dict of named losses, and as `model(images)`
in evaluation and returns one dict of `boxes`, `labels` and `scores` per image. Images are a list and
targets a list of dicts of `boxes` (x1, y1, x2, y2) and `labels`, batched by `collate`. With no loss
given, acc_trainer sums the model's losses and logs each by name; evaluation has no loss (the model
returns predictions) and reports the `recall` metric instead.

    cd examples
    acc-trainer --model detection:TinyDetector --dataset detection:rectangles --collate detection:collate \
        --forward with_targets --metrics detection:recall --epochs 4 --batch-size 32 --lr 3e-3

A torchvision detector trains the same way (`--model torchvision:...` builds classifiers only; give a
factory returning, say, `torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(...)`).
This one is small, so that CPU steps stay cheap: a 3-layer convolutional backbone whose 8 x 8 grid
cells each predict whether an object's centre lies in it, its class and its box. Each image's losses
are means over that image, and the batch's loss the mean over its images, so every image weighs the
same on any number of processes.

The data: 64 x 64 images holding 1 to 3 filled rectangles, reddish ones of class 1 and bluish ones of
class 2 (0 is the background, as in torchvision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SIZE, STRIDE = 64, 8
COLOURS = {1: (0.9, 0.25, 0.2), 2: (0.2, 0.35, 0.9)}


class Rectangles(Dataset):
    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)  # each sample from (seed, index) alone
        image = 0.5 + 0.05 * torch.randn(3, SIZE, SIZE, generator=g)
        boxes, labels = [], []
        for _ in range(torch.randint(1, 4, (), generator=g).item()):
            w, h = torch.randint(12, 29, (2,), generator=g).tolist()
            x, y = torch.randint(0, SIZE - w + 1, (), generator=g).item(), torch.randint(0, SIZE - h + 1, (), generator=g).item()
            label = torch.randint(1, 3, (), generator=g).item()
            image[:, y:y + h, x:x + w] = torch.tensor(COLOURS[label]).view(3, 1, 1)
            boxes.append([x, y, x + w, y + h])
            labels.append(label)
        return image.clamp(0, 1), {"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)}


def rectangles(train_size: int = 1024, eval_size: int = 256, seed: int = 0):
    """`--dataset detection:rectangles`: (training set, evaluation set)."""
    return Rectangles(train_size, seed), Rectangles(eval_size, seed + 1)


def collate(samples: list) -> tuple[list, list]:
    """`--collate detection:collate`: (list of images, list of target dicts), as torchvision's references batch."""
    return [image for image, _ in samples], [target for _, target in samples]


class TinyDetector(nn.Module):
    """`--model detection:TinyDetector`, with torchvision's detection interface."""

    def __init__(self, num_classes: int = 3, width: int = 32, threshold: float = 0.5):
        super().__init__()
        self.num_classes, self.threshold = num_classes, threshold
        self.backbone = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Conv2d(width, 1 + num_classes + 4, 1)  # objectness, class scores, box (x, y, log w, log h)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None):
        grid = self.head(self.backbone(torch.stack(list(images))))  # [B, 1 + C + 4, 8, 8]
        if self.training:
            if targets is None:
                raise ValueError("in training mode, the detector needs targets")
            return self.losses(grid, targets)
        return [self.detections(cells) for cells in grid]

    def losses(self, grid: torch.Tensor, targets: list[dict]) -> dict[str, torch.Tensor]:
        """Per image: objectness over every cell, class and box over the cells holding an object's centre;
        each the image's mean, then the mean over the images."""
        objectness, classifier, box = [], [], []
        for cells, target in zip(grid, targets):
            centres = (target["boxes"][:, :2] + target["boxes"][:, 2:]) / 2
            col, row = (centres / STRIDE).long().clamp(0, SIZE // STRIDE - 1).unbind(1)
            present = torch.zeros_like(cells[0])
            present[row, col] = 1
            # Few cells hold an object: each of those weighs as much as 8 empty ones.
            objectness.append(F.binary_cross_entropy_with_logits(cells[0], present, pos_weight=cells.new_tensor(8.0)))
            at = cells[:, row, col].T  # [objects, 1 + C + 4]
            classifier.append(F.cross_entropy(at[:, 1:1 + self.num_classes], target["labels"]))
            size = target["boxes"][:, 2:] - target["boxes"][:, :2]
            wanted = torch.cat([centres / STRIDE - torch.stack([col, row], 1), (size / STRIDE).log()], 1)
            predicted = torch.cat([at[:, -4:-2].sigmoid(), at[:, -2:]], 1)
            box.append(F.smooth_l1_loss(predicted, wanted))
        return {"loss_objectness": torch.stack(objectness).mean(), "loss_classifier": torch.stack(classifier).mean(),
                "loss_box_reg": torch.stack(box).mean()}

    def detections(self, cells: torch.Tensor) -> dict[str, torch.Tensor]:
        """The cells whose objectness passes the threshold, as boxes, labels and scores."""
        scores = cells[0].sigmoid()
        row, col = (scores > self.threshold).nonzero(as_tuple=True)
        at = cells[:, row, col].T
        centres = (torch.stack([col, row], 1) + at[:, -4:-2].sigmoid()) * STRIDE
        half = at[:, -2:].exp() * STRIDE / 2
        return {"boxes": torch.cat([centres - half, centres + half], 1),
                "labels": at[:, 1:1 + self.num_classes].argmax(1), "scores": scores[row, col]}


def recall(outputs: list[dict], targets: list[dict]) -> torch.Tensor:
    """`--metrics detection:recall`: per image, the share of its objects found: a predicted box of the same
    class overlapping it by an IoU of at least 0.5."""
    from torchvision.ops import box_iou

    found = []
    for predicted, target in zip(outputs, targets):
        iou = box_iou(target["boxes"], predicted["boxes"].to(target["boxes"].dtype))
        same = target["labels"][:, None] == predicted["labels"][None, :]
        found.append(((iou >= 0.5) & same).any(1).float().mean() if len(predicted["boxes"]) else torch.tensor(0.0))
    return torch.stack(found)
