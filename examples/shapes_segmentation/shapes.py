"""Find the rectangle: segmentation and box regression on generated images, trained by hvd-train.

Each image is faint noise with one bright axis-aligned rectangle, drawn from a fixed seed, so every rank, every run
and every resume sees the same data. The model says which pixels belong to the rectangle (a mask) and
where its box is (x0, y0, x1, y1 as fractions of the side). Nothing here knows about Horovod.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Rectangles(Dataset):
    """`count` images of image_size x image_size with one rectangle each, drawn once from `seed`; a sample is a dict
    of image, mask and box (DataLoader stacks them into a dict of batches)."""

    def __init__(self, count, image_size, seed):
        gen = torch.Generator().manual_seed(seed)
        side = image_size
        sizes = torch.randint(side // 4, side // 2 + 1, (count, 2), generator=gen)
        corners = (torch.rand(count, 2, generator=gen) * (side - sizes + 1)).long()
        self.boxes = torch.cat([corners, corners + sizes], dim=1)
        grid = torch.arange(side)
        inside_x = (grid >= self.boxes[:, None, 0]) & (grid < self.boxes[:, None, 2])
        inside_y = (grid >= self.boxes[:, None, 1]) & (grid < self.boxes[:, None, 3])
        self.masks = (inside_y[:, :, None] & inside_x[:, None, :]).float().unsqueeze(1)
        self.images = 0.4 * torch.rand(count, 1, side, side, generator=gen) + 0.6 * self.masks
        self.boxes = self.boxes.float() / side

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return {"image": self.images[index], "mask": self.masks[index], "box": self.boxes[index]}


def datasets(image_size=32, num_train=512, num_val=128, seed=0):
    """--dataset shapes:datasets. The training and validation sets, and what the model needs to know."""
    facts = {"in_channels": 1, "image_size": image_size}
    return Rectangles(num_train, image_size, seed), Rectangles(num_val, image_size, seed + 1), facts


class RectangleNet(nn.Module):
    """A full-resolution convolutional body with two heads: per-pixel mask logits, and the box from a downsampled
    map (pooling would lose where the rectangle is)."""

    def __init__(self, in_channels, image_size, width=16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
        self.mask_head = nn.Conv2d(width, 1, 1)
        self.box_head = nn.Sequential(nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(width, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                                      nn.Linear(8 * ((image_size + 3) // 4) ** 2, 4), nn.Sigmoid())

    def forward(self, images):
        features = self.body(images)
        return {"mask": self.mask_head(features), "box": self.box_head(features)}


def model(in_channels, image_size, width=16):
    """--model shapes:model. Called with the data set's facts it names, and --model-args (width=32)."""
    return RectangleNet(in_channels, image_size, width)


def box_iou(a, b):
    """Intersection over union of each row's boxes (x0, y0, x1, y1)."""
    low, high = torch.maximum(a[:, :2], b[:, :2]), torch.minimum(a[:, 2:], b[:, 2:])
    inter = (high - low).clamp(min=0).prod(dim=1)
    area = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(dim=1) + (b[:, 2:] - b[:, :2]).prod(dim=1)
    return inter / (area - inter).clamp(min=1e-6)


def confusion_matrix(predicted, truth, classes):
    """Pixel counts by (true class, predicted class), over every pixel of the batch: a classes x classes tensor."""
    return torch.bincount(truth.flatten() * classes + predicted.flatten(), minlength=classes**2).view(classes, classes)


def mean_iou(confusion):
    """Mean intersection over union of the classes from a confusion matrix (rows: truth, columns: prediction),
    over the classes that appear in the truth or the prediction. Any multiple of the matrix gives the same."""
    inter = confusion.diagonal()
    union = confusion.sum(dim=0) + confusion.sum(dim=1) - inter
    return (inter[union > 0] / union[union > 0]).mean()


class FindTheRectangle:
    """--task shapes:FindTheRectangle. Two loss terms (mask and box); the mean IoU of the two pixel classes
    (background, rectangle) over the whole data set, from a confusion matrix summed over every batch and rank (a
    helper: metrics.jsonl keeps it, the epoch line shows the mIoU made from it), and the boxes' IoU; best.pt keeps
    the epoch with the best validation mIoU."""
    terms = ("mask", "box")
    metrics = ("confusion", "box_iou")
    helpers = ("confusion",)
    derived = ("miou",)
    best_metric, best_mode = "val_miou", "max"

    def __init__(self, box_weight=5.0):
        self.box_weight = box_weight

    def loss(self, model, batch):
        out = model(batch["image"])
        return {"mask": F.binary_cross_entropy_with_logits(out["mask"], batch["mask"]),
                "box": self.box_weight * F.l1_loss(out["box"], batch["box"])}, out

    def metric_sums(self, out, batch):
        predicted, truth = (out["mask"] > 0).long(), (batch["mask"] > 0.5).long()
        return {"confusion": confusion_matrix(predicted, truth, 2),
                "box_iou": box_iou(out["box"].float(), batch["box"]).sum()}

    def derive(self, means):
        # means["confusion"] is the matrix over the epoch's samples divided by their number: IoU is a ratio of its
        # entries, so it is the data set's exact mIoU.
        return {"miou": mean_iou(means["confusion"])}
