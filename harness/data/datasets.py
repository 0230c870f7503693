"""Training data for `wus-train`: where examples come from, how a step picks them.

A `Split` (training or held-out) knows three things: how many examples it has,
which examples a training step uses (a pure function of (seed, step), so a
resumed run sees exactly the batches an uninterrupted one would), and how to
load given examples. Loading is separate from choosing so that each process
loads only the rows of its own devices (`wus.harness.data.batches`).

Sources, chosen by `--data` and the model's kind (`tasks.IMAGES` or
`tasks.TEXT`):

* "digits": the 1,797 8x8 handwritten digits bundled with scikit-learn;
* "stdlib": the bytes of Python's standard library (`text.stdlib_text`);
* "synthetic": random images or bytes, for step-time measurement;
* a path: a `.npz` file with arrays `images` ([n, h, w] or [n, h, w, c]; uint8
  scaled to [0, 1], or float) and `labels` (integer [n]), optionally
  `eval_images` and `eval_labels` as the held-out split; a folder of images,
  one sub-folder per class (as torchvision's ImageFolder); or, for text, a
  file or a folder of files, read as bytes.

Without an explicit held-out split, a fixed 10% of the examples (the same for
every seed) is held out.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import zipfile
import zlib

import numpy as np

from wus.harness.data import text
from wus.harness import errors
from wus.harness.models import tasks

EVAL_FRACTION = 0.1
SPLIT_SEED = 0  # fixes which examples are held out, whatever --seed is
SYNTHETIC_EXAMPLES = 1024  # images in the synthetic set, each made when loaded
SYNTHETIC_BYTES = 1 << 20  # bytes of synthetic text


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  """The order of range(n) in epoch `epoch`: int64 [n]."""
  return np.random.default_rng((seed, epoch)).permutation(n)


class ImageSplit:
  """Labelled images, drawn in epochs of a fresh permutation per (seed, epoch).

  Args:
    load_images: ids (int64 [k]) -> float32 [k, height, width, channels].
    labels: int32 [num_examples].
  """

  def __init__(self, load_images, labels: np.ndarray):
    self._load_images = load_images
    self.labels = np.asarray(labels, np.int32)

  def __len__(self) -> int:
    return len(self.labels)

  def sample(self, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    """Ids of step `step`'s global batch: int64 [batch_size].

    The run walks through epochs: positions `step * batch_size` onwards of the
    concatenation of one permutation per epoch.
    """
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = np.divmod(positions, len(self))
    return np.array([_permutation(len(self), seed, int(e))[o]
                     for e, o in zip(epochs, offsets, strict=True)])

  def eval_ids(self) -> np.ndarray:
    """Every example once: int64 [num_examples]."""
    return np.arange(len(self))

  def load(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    """{"image": float32 [k, h, w, c], "label": int32 [k]} of examples `ids`."""
    return {"image": self._load_images(ids), "label": self.labels[ids]}


class TextSplit:
  """Windows of `seq_len + 1` bytes of a text, identified by their start offset.

  Args:
    tokens: uint8 [num_bytes] (may be a memory map), `num_bytes > seq_len`.
    seq_len: model input length.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int):
    self.tokens, self.seq_len = tokens, seq_len

  def __len__(self) -> int:
    return len(self.tokens) - self.seq_len

  def sample(self, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    """Start offsets of step `step`'s global batch: int64 [batch_size]."""
    return text.window_starts(len(self.tokens), seed=seed, step=step, batch_size=batch_size,
                              seq_len=self.seq_len)

  def eval_ids(self) -> np.ndarray:
    """Start offsets of consecutive non-overlapping windows: int64 [num_windows]."""
    return np.arange(0, len(self), self.seq_len)

  def load(self, ids: np.ndarray) -> dict[str, np.ndarray]:
    """{"tokens": int32 [k, seq_len + 1]}: the windows starting at `ids`."""
    return {"tokens": text.gather_windows(self.tokens, ids, self.seq_len)}


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A training and a held-out split.

  Attributes:
    train, held_out: the splits (ImageSplit or TextSplit).
    num_classes: classes of image data; None for text.
    description: one line for the log: source and sizes.
  """

  train: ImageSplit | TextSplit
  held_out: ImageSplit | TextSplit
  num_classes: int | None
  description: str


def load(source: str, kind: str, *, seq_len: int, image_size: int, seed: int) -> Dataset:
  """The dataset named by `--data`, for a model reading `kind`.

  Args:
    source: "digits", "stdlib", "synthetic", or a path (see the module doc).
    kind: tasks.IMAGES or tasks.TEXT.
    seq_len: bytes per text example fed to the model.
    image_size: side in pixels of folder images (resized) and synthetic ones.
    seed: seed of synthetic data.

  Raises:
    errors.InputError: the source does not exist, does not hold data of this
      kind, or is too small.
  """
  if source == "synthetic":
    return _synthetic(kind, seq_len=seq_len, image_size=image_size, seed=seed)
  if source in ("digits", "stdlib"):
    wanted = tasks.IMAGES if source == "digits" else tasks.TEXT
    if kind != wanted:
      raise errors.InputError(f"--data={source} is {wanted} data; this model reads {kind}")
    return _digits() if source == "digits" else _text(text.load_tokens(), "stdlib", seq_len)
  path = pathlib.Path(source)
  if not path.exists():
    raise errors.InputError(f"--data={source}: no such file or directory")
  if kind == tasks.TEXT:
    return _text(text.load_tokens(path), str(path), seq_len)
  if path.is_dir():
    return _image_folder(path, image_size)
  if path.suffix != ".npz":
    raise errors.InputError(f"--data={source}: image data must be a .npz file or a folder "
                            "of class folders")
  return _npz(path)


def _held_out_ids(n: int) -> tuple[np.ndarray, np.ndarray]:
  """(train ids, held-out ids): a fixed random EVAL_FRACTION of range(n) held out."""
  perm = np.random.default_rng(SPLIT_SEED).permutation(n)
  num_eval = max(1, int(n * EVAL_FRACTION))
  return np.sort(perm[num_eval:]), np.sort(perm[:num_eval])


def _array_split(images: np.ndarray, labels: np.ndarray) -> ImageSplit:
  """An ImageSplit over in-memory images [n, h, w, c] (uint8 scaled to [0, 1])."""
  scale = 1 / 255 if images.dtype == np.uint8 else 1.0
  return ImageSplit(lambda ids: (images[ids] * scale).astype(np.float32), labels)


def _image_dataset(images, labels, eval_images, eval_labels, description) -> Dataset:
  """A Dataset of in-memory images; holds out a fixed share if no eval arrays are given."""
  if images.ndim == 3:
    images = images[..., None]
  if eval_images is None:
    train, held_out = _held_out_ids(len(images))
    images, labels, eval_images, eval_labels = (images[train], labels[train], images[held_out],
                                                labels[held_out])
  elif eval_images.ndim == 3:
    eval_images = eval_images[..., None]
  num_classes = int(max(labels.max(), eval_labels.max())) + 1
  return Dataset(_array_split(images, labels), _array_split(eval_images, eval_labels),
                 num_classes, f"{description}: {len(images)} training and "
                 f"{len(eval_images)} held-out images of shape {images.shape[1:]}, "
                 f"{num_classes} classes")


def _digits() -> Dataset:
  from sklearn.datasets import load_digits  # noqa: PLC0415  (slow import, only when used)
  digits = load_digits()
  return _image_dataset((digits.images / 16).astype(np.float32), digits.target, None, None,
                        "scikit-learn digits")


def _read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Every array of the .npz file `path`, read into memory.

  Raises:
    errors.InputError: it is not a readable .npz file (e.g. truncated).
  """
  try:
    with np.load(path) as arrays:
      return {name: arrays[name] for name in arrays.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
    raise errors.InputError(f"--data={path}: cannot read it as a .npz file of arrays ({e}); "
                            "is it complete? Write it with numpy.savez") from None


def _npz(path: pathlib.Path) -> Dataset:
  arrays = _read_npz(path)
  if not {"images", "labels"} <= arrays.keys():
    raise errors.InputError(f"--data={path}: a .npz needs arrays 'images' and 'labels'; "
                            f"it has {sorted(arrays)}")
  images, labels = arrays["images"], arrays["labels"]
  held_out = {"eval_images", "eval_labels"} & arrays.keys()
  if len(held_out) == 1:
    raise errors.InputError(f"--data={path}: has {held_out.pop()} but not its pair; a "
                            "held-out split needs both eval_images and eval_labels")
  eval_images, eval_labels = ((arrays["eval_images"], arrays["eval_labels"].astype(np.int32))
                              if held_out else (None, None))
  if images.ndim not in (3, 4) or len(images) != len(labels):
    raise errors.InputError(f"--data={path}: 'images' must be [n, h, w] or [n, h, w, c] and "
                            f"'labels' [n]; got {images.shape} and {labels.shape}")
  return _image_dataset(images, labels.astype(np.int32), eval_images, eval_labels, str(path))


def _image_folder(root: pathlib.Path, image_size: int) -> Dataset:
  from PIL import Image  # noqa: PLC0415  (only folder data needs Pillow)

  extensions = set(Image.registered_extensions())
  classes = sorted(p.name for p in root.iterdir() if p.is_dir())
  files = [(f, c) for c, name in enumerate(classes)
           for f in sorted((root / name).rglob("*")) if f.suffix.lower() in extensions]
  if len(files) < 2:
    raise errors.InputError(f"--data={root}: found {len(files)} images; an image folder "
                            "holds one sub-folder of images per class")

  def load_images(ids: np.ndarray) -> np.ndarray:
    """RGB, resized to image_size x image_size, scaled to [0, 1]: float32 [k, s, s, 3]."""
    out = np.empty((len(ids), image_size, image_size, 3), np.float32)
    for i, k in enumerate(ids):
      with Image.open(files[k][0]) as image:
        out[i] = np.asarray(image.convert("RGB").resize((image_size, image_size))) / 255
    return out

  labels = np.array([c for _, c in files], np.int32)
  train, held_out = _held_out_ids(len(files))
  return Dataset(ImageSplit(lambda ids: load_images(train[ids]), labels[train]),
                 ImageSplit(lambda ids: load_images(held_out[ids]), labels[held_out]),
                 len(classes), f"{root}: {len(train)} training and {len(held_out)} held-out "
                 f"images in {len(classes)} classes, resized to {image_size}x{image_size}")


def _text(tokens: np.ndarray, description: str, seq_len: int) -> Dataset:
  train, held_out = text.split(tokens, EVAL_FRACTION)
  if len(held_out) <= seq_len:
    raise errors.InputError(f"--data={description}: {len(tokens)} bytes are too few for "
                            f"--seq_len={seq_len} (the held-out 10% must exceed it)")
  return Dataset(TextSplit(train, seq_len), TextSplit(held_out, seq_len), None,
                 f"{description}: {len(train):,} training and {len(held_out):,} held-out bytes")


def _synthetic(kind: str, *, seq_len: int, image_size: int, seed: int) -> Dataset:
  rng = np.random.default_rng(seed)
  if kind == tasks.TEXT:
    tokens = rng.integers(0, 256, SYNTHETIC_BYTES, dtype=np.uint8)
    return _text(tokens, "synthetic", seq_len)
  labels = rng.integers(0, 10, SYNTHETIC_EXAMPLES).astype(np.int32)

  def load_images(ids: np.ndarray) -> np.ndarray:
    """Standard-normal images, image `k` a pure function of (seed, k): float32 [k, s, s, 3]."""
    return np.stack([np.random.default_rng((seed, k)).standard_normal(
        (image_size, image_size, 3), np.float32) for k in ids])

  train, held_out = _held_out_ids(SYNTHETIC_EXAMPLES)
  return Dataset(ImageSplit(lambda ids: load_images(train[ids]), labels[train]),
                 ImageSplit(lambda ids: load_images(held_out[ids]), labels[held_out]), 10,
                 f"synthetic: {len(train)} training and {len(held_out)} held-out random "
                 f"{image_size}x{image_size} images, 10 classes")
