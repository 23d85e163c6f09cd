"""Federated datasets whose users come from the data, read from their published local layouts.

Users are the data's own: a writer (LEAF FEMNIST), a speaking role (LEAF Shakespeare), a poster
(StackOverflow), a photographer (FLAIR). Nothing is re-partitioned, and the population N used for
accounting is the number of users in the files. Nothing is downloaded; a missing or malformed folder is an
error that names the files expected, where they come from, and what was wrong.

| dataset | layout read | users (published) |
|---|---|---|
| LEAF FEMNIST | ``train/*.json``, ``test/*.json`` (LEAF's json) | 3,550 writers (LEAF, full size; TFF's EMNIST: 3,400) |
| LEAF Shakespeare | ``train/*.json``, ``test/*.json`` (LEAF's json) | 1,129 roles (LEAF; TFF's Shakespeare: 715) |
| StackOverflow | ``stackoverflow_{train,test}.h5`` + ``stackoverflow.word_count`` (TFF's release) | 342,477 train posters |
| FLAIR | one hdf5 file (``prepare_dataset.py`` of Apple's ml-flair) | 41,131 train photographers |

LEAF's json files (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings") hold
``{"users": [ids], "num_samples": [counts], "user_data": {id: {"x": [...], "y": [...]}}}`` (and optionally
``hierarchies``); LEAF's scripts write them to ``data/<dataset>/data/train`` and ``.../test``.

The hdf5 layouts need h5py: ``pip install h5py`` (or ``pip install "fed-dp[data]"``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "FLAIR_FILE",
    "STACKOVERFLOW_FILES",
    "LeafSplit",
    "flair_labels",
    "flair_user",
    "flair_users",
    "load_leaf",
    "read_word_counts",
    "stackoverflow_sentences",
    "stackoverflow_users",
]

LeafSplit = dict[str, tuple[list[Any], list[Any]]]


# --------------------------------------------------------------------------------------------------
# LEAF (FEMNIST, Shakespeare)
# --------------------------------------------------------------------------------------------------


def _leaf_files(folder: Path, split: str, dataset: str) -> list[Path]:
    files = sorted((folder / split).glob("*.json"))
    if not files:
        where = "the folder does not exist" if not (folder / split).is_dir() else "it holds no .json file"
        raise FileNotFoundError(
            f"LEAF {dataset} not found: {folder / split} ({where}). Put LEAF's {split}/*.json files there: LEAF's "
            f"preprocess.sh for {dataset} writes them to leaf/data/{dataset}/data/{split}/; point task.root at the "
            "folder holding train/ and test/.")
    return files


def _read_leaf_file(path: Path) -> LeafSplit:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        users, counts, data = document["users"], document["num_samples"], document["user_data"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a LEAF json file with users, num_samples and user_data "
                         f"({type(error).__name__}: {error})") from error
    if len(users) != len(counts):
        raise ValueError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
    out: LeafSplit = {}
    for user, count in zip(users, counts):
        record = data.get(user) if isinstance(data, dict) else None
        if not isinstance(record, dict) or "x" not in record or "y" not in record:
            raise ValueError(f"{path}: user {user!r} has no user_data entry with x and y")
        if not len(record["x"]) == len(record["y"]) == count:
            raise ValueError(f"{path}: user {user!r} has {len(record['x'])} x, {len(record['y'])} y and num_samples "
                             f"{count}; they must agree")
        out[user] = (record["x"], record["y"])
    return out


def load_leaf(root: str | Path, dataset: str) -> tuple[LeafSplit, LeafSplit]:
    """Every user of LEAF's ``train/*.json`` and ``test/*.json`` under ``root`` (the ``data`` folder of a LEAF
    dataset, e.g. ``leaf/data/femnist/data``): ``(train, test)``, each ``{user id: (x list, y list)}``.

    Files are read in name order and users kept in file order. A user listed twice in one split (in two
    files) is an error; LEAF's sample-wise split puts the same users in train and test, its user-wise split
    different ones: both are read as they are.
    """
    folder = Path(root)
    splits = []
    for split in ("train", "test"):
        merged: LeafSplit = {}
        for path in _leaf_files(folder, split, dataset):
            for user, examples in _read_leaf_file(path).items():
                if user in merged:
                    raise ValueError(f"{path}: user {user!r} appears in two {split} files; LEAF lists each user once")
                merged[user] = examples
        if not merged:
            raise ValueError(f"{folder / split}: the LEAF json files list no users")
        splits.append(merged)
    return splits[0], splits[1]


# --------------------------------------------------------------------------------------------------
# StackOverflow (TensorFlow Federated's hdf5 release)
# --------------------------------------------------------------------------------------------------

#: The files read from TFF's StackOverflow release: ``stackoverflow.tar.bz2`` (the h5 files) and
#: ``stackoverflow.word_count.tar.bz2`` (word counts over the training set, most frequent first).
STACKOVERFLOW_FILES = ("stackoverflow_train.h5", "stackoverflow_test.h5", "stackoverflow.word_count")


def _h5py():
    try:
        import h5py
    except ImportError as error:
        raise ImportError("reading StackOverflow's or FLAIR's hdf5 files needs h5py: pip install h5py "
                          "(or pip install \"fed-dp[data]\")") from error
    return h5py


@lru_cache(maxsize=8)
def _open_h5(path: str):
    """One read-only handle per file and process (users load lazily, one at a time)."""
    h5py = _h5py()
    try:
        return h5py.File(path, "r")
    except OSError as error:
        raise ValueError(f"{path}: not an hdf5 file ({error})") from error


def _stackoverflow_folder(root: str | Path) -> Path:
    folder = Path(root)
    missing = [name for name in STACKOVERFLOW_FILES if not (folder / name).is_file()]
    if missing:
        where = "the folder does not exist" if not folder.is_dir() else "missing: " + ", ".join(missing)
        raise FileNotFoundError(
            f"StackOverflow not found in {folder} ({where}). Put {', '.join(STACKOVERFLOW_FILES)} there: the h5 "
            "files come from TensorFlow Federated's stackoverflow.tar.bz2 and the word counts from its "
            "stackoverflow.word_count.tar.bz2 (the release tff.simulation.datasets.stackoverflow used; extract both).")
    return folder


def _examples_group(path: Path):
    handle = _open_h5(str(path))
    if "examples" not in handle:
        raise ValueError(f"{path}: no /examples group; TFF's StackOverflow h5 files hold /examples/<client id>/tokens")
    return handle["examples"]


def read_word_counts(path: str | Path) -> list[tuple[str, int]]:
    """TFF's ``stackoverflow.word_count``: one ``word count`` pair per line (whitespace-separated), most
    frequent first."""
    pairs = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"{path}, line {number}: expected 'word count', got {line!r}")
        pairs.append((parts[0], int(parts[1])))
    if not pairs:
        raise ValueError(f"{path}: no word counts")
    return pairs


def stackoverflow_users(root: str | Path, split: str = "train") -> tuple[Path, list[str]]:
    """The h5 file of ``split`` (``train`` or ``test``) and its client ids (sorted, as h5py lists them)."""
    folder = _stackoverflow_folder(root)
    path = folder / f"stackoverflow_{split}.h5"
    ids = list(_examples_group(path).keys())
    if not ids:
        raise ValueError(f"{path}: /examples holds no client")
    return path, ids


def stackoverflow_sentences(path: Path, client: str) -> list[list[str]]:
    """The ``tokens`` of every example (post sentence) of ``client``: TFF stores each as one space-separated
    byte string in ``/examples/<client>/tokens``."""
    group = _examples_group(path)
    if client not in group or "tokens" not in group[client]:
        raise ValueError(f"{path}: no /examples/{client}/tokens dataset")
    return [(t.decode("utf-8") if isinstance(t, bytes) else str(t)).split() for t in group[client]["tokens"][()]]


# --------------------------------------------------------------------------------------------------
# FLAIR (Song et al. 2022), the hdf5 file of ml-flair's prepare_dataset.py
# --------------------------------------------------------------------------------------------------

#: The file name FLAIR's benchmark code reads (prepare_dataset.py --output_file chooses it).
FLAIR_FILE = "flair_federated.hdf5"


def _flair_file(root: str | Path, file: str = FLAIR_FILE) -> Path:
    path = Path(root) / file if not str(root).endswith((".hdf5", ".h5")) else Path(root)
    if not path.is_file():
        raise FileNotFoundError(
            f"FLAIR not found: {path} does not exist. Make it with Apple's ml-flair: download_dataset.py, then "
            f"prepare_dataset.py --dataset_dir=... --output_file={path} (the federated layout /<partition>/"
            "<user id>/images and labels, and /metadata/label_counter).")
    return path


def flair_labels(root: str | Path, file: str = FLAIR_FILE) -> list[str]:
    """The coarse label names (17 in FLAIR), sorted: the keys of ``/metadata/label_counter`` (a JSON object)."""
    path = _flair_file(root, file)
    handle = _open_h5(str(path))
    if "metadata/label_counter" not in handle:
        raise ValueError(f"{path}: no /metadata/label_counter; FLAIR's prepare_dataset.py writes the label counts there")
    raw = handle["metadata/label_counter"][()]
    try:
        counter = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: /metadata/label_counter is not JSON ({error})") from error
    return sorted(counter)


def flair_users(root: str | Path, split: str, file: str = FLAIR_FILE) -> tuple[Path, list[str]]:
    """The FLAIR file and the user ids of ``split`` (``train``, ``val``/``dev`` or ``test``)."""
    path = _flair_file(root, file)
    handle = _open_h5(str(path))
    if split not in handle:
        raise ValueError(f"{path}: no /{split} group (it has {', '.join(sorted(handle))}); FLAIR's federated layout "
                         "is /<partition>/<user id>/images")
    return path, list(handle[split].keys())


def flair_user(path: Path, split: str, user: str, labels: list[str], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One FLAIR user: images (n, H, W, 3) uint8 → float32 (n, 3, size, size) in [0, 1] (mean of
    (H/size)² pixel blocks: 256 → 32 for 2 CPU cores), and labels ("a|b|c" byte strings) → multi-hot float32
    (n, len(labels))."""
    group = _open_h5(str(path))[split]
    if user not in group or "images" not in group[user] or "labels" not in group[user]:
        raise ValueError(f"{path}: /{split}/{user} needs the datasets images and labels")
    images = np.asarray(group[user]["images"][()])
    raw_labels = group[user]["labels"][()]
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8 or len(raw_labels) != len(images):
        raise ValueError(f"{path}: /{split}/{user}/images must be uint8 (n, H, W, 3) with one labels entry per "
                         f"image, got {images.dtype} {images.shape} and {len(raw_labels)} labels")
    x = torch.from_numpy(images).permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    if x.shape[2] != size or x.shape[3] != size:
        if x.shape[2] % size or x.shape[3] % size:
            raise ValueError(f"{path}: images of {x.shape[2]}x{x.shape[3]} pixels cannot be reduced to {size}x{size}")
        x = torch.nn.functional.avg_pool2d(x, (x.shape[2] // size, x.shape[3] // size))
    index = {name: i for i, name in enumerate(labels)}
    y = torch.zeros((len(images), len(labels)), dtype=torch.float32)
    for row, entry in enumerate(raw_labels):
        text = entry.decode("utf-8") if isinstance(entry, bytes) else str(entry)
        for name in filter(None, text.split("|")):
            if name not in index:
                raise ValueError(f"{path}: /{split}/{user} has label {name!r}, not in /metadata/label_counter")
            y[row, index[name]] = 1.0
    return x, y

