"""Tests of wus.harness.data.datasets and wus.harness.data.batches: sources, order, placement."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from PIL import Image

from wus.harness.data import batches, datasets
from wus.harness import errors
from wus.harness.models import tasks

LOAD = dict(seq_len=8, image_size=6, seed=0)


@pytest.fixture(scope="module")
def digits():
  return datasets.load("digits", tasks.IMAGES, **LOAD)


def test_digits_are_split_and_scaled(digits):
  assert (len(digits.train), len(digits.held_out), digits.num_classes) == (1618, 179, 10)
  batch = digits.train.load(np.arange(4))
  assert batch["image"].shape == (4, 8, 8, 1) and batch["image"].dtype == np.float32
  assert 0 <= batch["image"].min() and batch["image"].max() <= 1
  assert batch["label"].dtype == np.int32


def test_image_order_is_a_permutation_per_epoch_and_a_function_of_seed_and_step(digits):
  n, batch_size = len(digits.train), 64
  steps_per_epoch = -(-n // batch_size)
  first_epoch = np.concatenate([digits.train.sample(seed=1, step=s, batch_size=batch_size)
                                for s in range(steps_per_epoch)])[:n]
  np.testing.assert_array_equal(np.sort(first_epoch), np.arange(n))
  np.testing.assert_array_equal(digits.train.sample(seed=1, step=5, batch_size=batch_size),
                                first_epoch[5 * batch_size:6 * batch_size])
  assert not np.array_equal(digits.train.sample(seed=2, step=5, batch_size=batch_size),
                            first_epoch[5 * batch_size:6 * batch_size])


def test_npz_with_held_out_arrays(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "data.npz"
  np.savez(path, images=rng.integers(0, 256, (20, 5, 5), np.uint8),
           labels=np.arange(20) % 3, eval_images=np.full((4, 5, 5), 255, np.uint8),
           eval_labels=np.arange(4) % 3)
  ds = datasets.load(str(path), tasks.IMAGES, **LOAD)
  assert (len(ds.train), len(ds.held_out), ds.num_classes) == (20, 4, 3)
  np.testing.assert_array_equal(ds.held_out.load(np.arange(2))["image"],
                                np.ones((2, 5, 5, 1), np.float32))


def test_npz_without_held_out_arrays_holds_out_a_tenth(tmp_path):
  path = tmp_path / "data.npz"
  np.savez(path, images=np.zeros((30, 4, 4, 3), np.float32), labels=np.arange(30) % 2)
  ds = datasets.load(str(path), tasks.IMAGES, **LOAD)
  assert (len(ds.train), len(ds.held_out)) == (27, 3)


def test_image_folder(tmp_path):
  for c, name in enumerate(["cat", "dog"]):
    (tmp_path / name).mkdir()
    for i in range(5):
      Image.new("L", (10, 7), color=100 * c).save(tmp_path / name / f"{i}.png")
  ds = datasets.load(str(tmp_path), tasks.IMAGES, **LOAD)
  assert (len(ds.train) + len(ds.held_out), ds.num_classes) == (10, 2)
  batch = ds.train.load(np.arange(len(ds.train)))
  assert batch["image"].shape == (len(ds.train), 6, 6, 3)
  np.testing.assert_allclose(batch["image"][:, 0, 0, 0], batch["label"] * 100 / 255, rtol=1e-6)


def test_text_file(tmp_path):
  path = tmp_path / "text.txt"
  path.write_bytes(bytes(range(200)))
  ds = datasets.load(str(path), tasks.TEXT, **LOAD)
  assert ds.num_classes is None
  starts = ds.train.sample(seed=0, step=3, batch_size=4)
  windows = ds.train.load(starts)["tokens"]
  assert windows.shape == (4, 9)
  np.testing.assert_array_equal(windows[:, 0], starts)
  np.testing.assert_array_equal(ds.held_out.eval_ids(), [0, 8])  # 20 held-out bytes


def test_synthetic_images_are_a_function_of_seed():
  a = datasets.load("synthetic", tasks.IMAGES, **LOAD)
  b = datasets.load("synthetic", tasks.IMAGES, **LOAD)
  np.testing.assert_array_equal(a.train.load(np.arange(3))["image"],
                                b.train.load(np.arange(3))["image"])
  assert a.train.load(np.arange(1))["image"].shape == (1, 6, 6, 3)


@pytest.mark.parametrize("source, kind, match", [
    ("/no/such/path", tasks.IMAGES, "no such file or directory"),
    ("digits", tasks.TEXT, "is images data; this model reads text"),
    ("stdlib", tasks.IMAGES, "is text data; this model reads images"),
])
def test_bad_sources(source, kind, match):
  with pytest.raises(errors.InputError, match=match):
    datasets.load(source, kind, **LOAD)


def test_bad_files(tmp_path):
  np.savez(tmp_path / "x.npz", x=np.zeros(3))
  with pytest.raises(errors.InputError, match="needs arrays 'images' and 'labels'"):
    datasets.load(str(tmp_path / "x.npz"), tasks.IMAGES, **LOAD)
  (tmp_path / "short.txt").write_bytes(b"abc")
  with pytest.raises(errors.InputError, match="too few"):
    datasets.load(str(tmp_path / "short.txt"), tasks.TEXT, **LOAD)
  (tmp_path / "x.csv").write_text("1,2")
  with pytest.raises(errors.InputError, match="must be a .npz file or a folder"):
    datasets.load(str(tmp_path / "x.csv"), tasks.IMAGES, **LOAD)


def test_on_mesh_loads_each_device_rows_once():
  mesh = jax.make_mesh((8,), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  calls = []

  def load_rows(start, stop):
    calls.append((start, stop))
    return {"x": np.arange(start, stop, dtype=np.int32)[:, None] * [1, 10]}

  batch = batches.on_mesh(load_rows, 16, sharding)
  assert sorted(calls) == [(2 * d, 2 * d + 2) for d in range(8)]
  assert batch["x"].sharding == sharding
  np.testing.assert_array_equal(batch["x"], np.arange(16)[:, None] * [1, 10])


def test_eval_batches_pad_with_weight_zero(digits):
  mesh = jax.make_mesh((8,), ("data",))
  out = list(batches.eval_batches(digits.held_out, batch_size=64, max_examples=1000,
                                  sharding=NamedSharding(mesh, P("data"))))
  assert len(out) == 3  # 179 = 64 + 64 + 51
  weights = np.concatenate([np.asarray(b["weight"]) for b in out])
  np.testing.assert_array_equal(weights, np.arange(192) < 179)
  np.testing.assert_array_equal(np.asarray(out[2]["label"])[:51], digits.held_out.labels[128:])


def test_eval_batches_stop_at_max_examples(digits):
  mesh = jax.make_mesh((8,), ("data",))
  out = list(batches.eval_batches(digits.held_out, batch_size=64, max_examples=100,
                                  sharding=NamedSharding(mesh, P("data"))))
  assert len(out) == 2 and sum(float(np.sum(b["weight"])) for b in out) == 100
