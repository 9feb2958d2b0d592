"""Image preprocessing taken from the backbone's own data config.

An image backbone exposes ``data_config()`` → timm's resolved config: ``input_size`` (3, H, W),
``mean``, ``std``, ``crop_pct``, ``interpolation``. Without one (``setup(backbone=None)`` or a
backbone lacking the method) uqbench uses :data:`DEFAULT_DATA_CONFIG`: ImageNet mean/std,
224 px, crop 0.875, bicubic (timm's defaults for ViTs).

Evaluation follows timm's crop_pct convention (resize the shorter side to size / crop_pct, then
centre-crop to size; ``crop_mode`` squash/border as in timm): timm's own eval transform is used,
so the numbers match timm's. Training
uses a random resized crop (``scale``, ``ratio``) and a horizontal flip, or the eval transform
when ``augment`` is false.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from timm.data.transforms_factory import transforms_imagenet_eval
from torchvision import transforms as T

from uqbench.contracts import InputBackbone

DEFAULT_DATA_CONFIG: dict[str, Any] = {
    "input_size": (3, 224, 224),
    "mean": (0.485, 0.456, 0.406),
    "std": (0.229, 0.224, 0.225),
    "crop_pct": 0.875,
    "interpolation": "bicubic",
}
INTERPOLATIONS = {"bilinear": T.InterpolationMode.BILINEAR,
                  "bicubic": T.InterpolationMode.BICUBIC,
                  "nearest": T.InterpolationMode.NEAREST}
CROP_MODES = ("center", "squash", "border")  # timm's eval crop modes


@dataclass(frozen=True)
class ImagePreprocessing:
    """Resolved preprocessing: output size (H, W), normalisation and the eval crop."""

    size: tuple[int, int]
    mean: tuple[float, ...]  # one per channel (RGB)
    std: tuple[float, ...]
    crop_pct: float
    interpolation: str
    crop_mode: str = "center"

    @classmethod
    def from_backbone(cls, backbone: InputBackbone | None = None, crop_pct: float | None = None
                      ) -> ImagePreprocessing:
        """From ``backbone.data_config()`` where it exists, else the defaults.

        ``crop_pct`` overrides the backbone's (e.g. 1.0: resize the whole image, no crop).
        """
        config = dict(DEFAULT_DATA_CONFIG)
        own = None if backbone is None else backbone.data_config()
        config.update({k: v for k, v in (own or {}).items() if v is not None})
        if crop_pct is not None:
            config["crop_pct"] = crop_pct
        input_size = tuple(int(v) for v in config["input_size"])
        if len(input_size) != 3 or input_size[0] != 3:
            raise ValueError(f"backbone data_config input_size {input_size} is not (3, H, W); "
                             f"image datasets are RGB")
        interpolation = str(config["interpolation"])
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation '{interpolation}' is not supported; valid: "
                             f"{', '.join(INTERPOLATIONS)}")
        crop_mode = str(config.get("crop_mode") or "center")
        if crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode '{crop_mode}' is not supported; valid: "
                             f"{', '.join(CROP_MODES)}")
        crop = float(config["crop_pct"])
        if not 0 < crop <= 1:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop}")
        return cls(size=(input_size[1], input_size[2]),
                   mean=tuple(float(v) for v in config["mean"]),
                   std=tuple(float(v) for v in config["std"]),
                   crop_pct=crop, interpolation=interpolation, crop_mode=crop_mode)

    def eval_transform(self) -> Callable:
        """PIL image → (3, H, W) float tensor: resize to size / crop_pct, centre-crop, normalise."""
        return transforms_imagenet_eval(img_size=self.size, crop_pct=self.crop_pct,
                                        crop_mode=self.crop_mode,
                                        interpolation=self.interpolation,
                                        mean=self.mean, std=self.std)

    def train_transform(self, augment: bool = True, scale: Sequence[float] = (0.08, 1.0),
                        ratio: Sequence[float] = (3 / 4, 4 / 3), hflip: float = 0.5
                        ) -> Callable:
        """PIL image → (3, H, W) float tensor with random resized crop and horizontal flip."""
        if not augment:
            return self.eval_transform()
        lo, hi = (float(v) for v in scale)
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"dataset.scale {list(scale)} must satisfy 0 < lo <= hi <= 1")
        if not 0 <= hflip <= 1:
            raise ValueError(f"dataset.hflip must be a probability in [0, 1], got {hflip}")
        return T.Compose([
            T.RandomResizedCrop(self.size, scale=(lo, hi), ratio=tuple(float(r) for r in ratio),
                                interpolation=INTERPOLATIONS[self.interpolation]),
            T.RandomHorizontalFlip(hflip),
            T.ToTensor(),
            T.Normalize(self.mean, self.std),
        ])

    def settings(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
