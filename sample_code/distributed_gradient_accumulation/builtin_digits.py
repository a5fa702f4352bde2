"""The built-in default dataset: scikit-learn's handwritten digits, written once in MNIST's idx format.

scikit-learn ships 1,797 real 8x8 handwritten digits (no download). Each is upscaled to 28x28 (3x nearest
neighbour to 24x24, centred with a 2-pixel border, values 0-16 stretched to 0-255) and split 80/20 into
train and test with a fixed seed, then written as the four files ``ds.MnistDataset`` reads. The training
script therefore reads the built-in data through exactly the same ``ds.MnistDataset`` path as real MNIST.
"""
import os
import struct
import tempfile

import numpy as np

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "ms_gradaccum", "digits_mnist")


def _to_28x28(images_8x8: np.ndarray) -> np.ndarray:
    big = np.kron(images_8x8, np.ones((3, 3)))                     # (N, 24, 24), values 0..16
    big = np.pad(big, ((0, 0), (2, 2), (2, 2)))                     # (N, 28, 28)
    return np.clip(np.rint(big * (255.0 / 16.0)), 0, 255).astype(np.uint8)


def _write_idx(directory: str, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    image_file, label_file = FILES[split]
    with open(os.path.join(directory, image_file), "wb") as handle:
        handle.write(struct.pack(">IIII", 2051, len(images), 28, 28))
        handle.write(images.tobytes())
    with open(os.path.join(directory, label_file), "wb") as handle:
        handle.write(struct.pack(">II", 2049, len(labels)))
        handle.write(labels.astype(np.uint8).tobytes())


def ensure_digits_mnist(directory: str = "") -> str:
    """Write the dataset into ``directory`` (default: the user cache) unless it is there; return the path.

    Safe when several ranks call it at once: each writes a private temporary folder and renames it into
    place; the first rename wins and the others discard theirs.
    """
    directory = directory or default_cache_dir()
    if all(os.path.exists(os.path.join(directory, name)) for pair in FILES.values() for name in pair):
        return directory
    from sklearn.datasets import load_digits  # only needed the first time

    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    images, labels = _to_28x28(digits.images[order]), digits.target[order]
    n_train = int(0.8 * len(labels))
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".digits_mnist.", dir=parent)
    _write_idx(staging, "train", images[:n_train], labels[:n_train])
    _write_idx(staging, "test", images[n_train:], labels[n_train:])
    try:
        os.rename(staging, directory)
    except OSError:  # another process got there first
        for name in os.listdir(staging):
            os.remove(os.path.join(staging, name))
        os.rmdir(staging)
    return directory
