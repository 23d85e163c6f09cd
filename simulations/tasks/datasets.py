"""Loaders for the standard local files of CIFAR-10, MNIST, SNLI, QNLI, Penn Treebank and E2E, and the
Barcode-MNIST construction. (Datasets whose users come from the data: ``federated_datasets``.)

Nothing here downloads: every loader reads the files a dataset's own distribution ships, from a local
directory, and raises :class:`FileNotFoundError` naming exactly which files to put where when they are
missing, or :class:`ValueError` naming the file when one is malformed.

The image loaders return ``(train_x, train_y, test_x, test_y)`` with float32 inputs scaled to [0, 1] (pixel / 255,
no mean/std normalization: normalizing is a modelling choice left to the task builder) and int64 labels; the
text loaders return every split's raw text (tokenizing is the task's: ``simulations.tasks.text``).

``make_barcode_mnist`` builds the heavy-tailed Barcode-MNIST of seed 003 (Tang, Zhiyanov & Lécuyer,
"On the Performance of Differentially Private Optimization with Heavy-Tail Class Imbalance", Appendix B),
which follows Kunstner et al. (2024, Appendix A2): extra classes are MNIST digits with a binary number
written in the image corner; classes are subsampled to be heavy-tailed.
"""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

__all__ = [
    "BARCODE_MNIST_GROUPS",
    "CIFAR10_FOLDER",
    "QNLI_LABELS",
    "SNLI_LABELS",
    "barcode_mnist_class_sizes",
    "load_cifar10",
    "load_e2e",
    "load_mnist",
    "load_ptb",
    "load_qnli",
    "load_snli",
    "make_barcode_mnist",
]

# --------------------------------------------------------------------------------------------------
# CIFAR-10 (python version: cifar-10-python.tar.gz → cifar-10-batches-py/)
# --------------------------------------------------------------------------------------------------

CIFAR10_FOLDER = "cifar-10-batches-py"
_CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR10_TEST = "test_batch"
_CIFAR10_PIXELS = 3 * 32 * 32

# Globals a CIFAR-10 batch pickle may reference (numpy array reconstruction only). Anything else is
# refused, so a tampered file cannot run code when loaded.
_SAFE_PICKLE_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the numpy globals needed to rebuild plain arrays."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if (module, name) not in _SAFE_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            # Pickles written by numpy < 2 (the original CIFAR files) name numpy.core; numpy 2 moved it.
            module = "numpy._core" + module[len("numpy.core"):]
        return super().find_class(module, name)


def _cifar_dir(root: str | Path) -> Path:
    """``root`` itself when it holds the batch files, else ``root/cifar-10-batches-py``."""
    root = Path(root)
    if root.name == CIFAR10_FOLDER or (root / _CIFAR10_TEST).is_file():
        return root
    return root / CIFAR10_FOLDER


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a CIFAR-10 python batch file ({e})") from e
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a dict with keys b'data' and b'labels', got {type(batch)}")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{path}: missing key b'data' or b'labels' (keys: {sorted(map(str, batch))})")
    data = np.asarray(data)
    labels = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR10_PIXELS:
        raise ValueError(
            f"{path}: b'data' must be uint8 of shape (n, {_CIFAR10_PIXELS}), "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    if labels.shape != (data.shape[0],):
        raise ValueError(f"{path}: {data.shape[0]} images but {labels.shape[0]} labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must lie in 0..9, got {labels.min()}..{labels.max()}")
    return data, labels


def _cifar_tensors(batches: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.concatenate([d for d, _ in batches])
    labels = np.concatenate([l for _, l in batches])
    # Each row is 1024 red, 1024 green, 1024 blue values, each plane 32×32 row-major.
    x = torch.from_numpy(data).reshape(-1, 3, 32, 32).to(torch.float32).div_(255.0)
    return x, torch.from_numpy(labels)


def load_cifar10(root: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read CIFAR-10 from the standard python-version files (``cifar-10-python.tar.gz``, extracted).

    ``root`` is either the ``cifar-10-batches-py`` folder itself or its parent. The folder must hold
    ``data_batch_1`` … ``data_batch_5`` (training) and ``test_batch`` (test): pickled dicts with
    ``b"data"`` (uint8, (n, 3072): the R, G and B 32×32 planes of each image, row-major) and
    ``b"labels"`` (n ints in 0..9). The number of rows per batch is read from the files.

    Returns ``(train_x, train_y, test_x, test_y)``: x float32 (n, 3, 32, 32) = pixel / 255 in [0, 1]
    (not mean/std-normalized), y int64 (n,). The pickles are read with an unpickler that only
    rebuilds numpy arrays, so a tampered file cannot execute code.
    """
    folder = _cifar_dir(root)
    wanted = [*_CIFAR10_TRAIN, _CIFAR10_TEST]
    missing = [name for name in wanted if not (folder / name).is_file()]
    if missing:
        where = "the folder does not exist" if not folder.is_dir() else "missing: " + ", ".join(missing)
        raise FileNotFoundError(
            f"CIFAR-10 not found in {folder} ({where}). Put data_batch_1 … data_batch_5 and test_batch "
            f"from cifar-10-python.tar.gz into {folder}/ (extracting the archive into "
            f"{folder.parent} creates that folder)."
        )
    train = [_read_cifar_batch(folder / name) for name in _CIFAR10_TRAIN]
    test = [_read_cifar_batch(folder / _CIFAR10_TEST)]
    return (*_cifar_tensors(train), *_cifar_tensors(test))


# --------------------------------------------------------------------------------------------------
# MNIST (idx files, raw or .gz)
# --------------------------------------------------------------------------------------------------

_IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned byte, 1 dimension
_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _find_idx(folders: Sequence[Path], name: str) -> Path | None:
    """First existing file among ``name``, ``name.gz`` and the dotted spelling (``…-images.idx3-ubyte``)."""
    dotted = name.replace("-idx", ".idx")
    for folder in folders:
        for candidate in (name, name + ".gz", dotted, dotted + ".gz"):
            if (folder / candidate).is_file():
                return folder / candidate
    return None


def _read_idx(path: Path, magic: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # e.g. a .gz file that is not gzip
        raise ValueError(f"{path}: cannot be read as an idx file ({e})") from e
    ndim = 3 if magic == _IDX_IMAGES_MAGIC else 1
    header = 4 * (1 + ndim)
    if len(raw) < header:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} bytes)")
    found = int.from_bytes(raw[0:4], "big")
    if found != magic:
        kind = "images" if magic == _IDX_IMAGES_MAGIC else "labels"
        raise ValueError(f"{path}: bad magic number {found}, expected {magic} for an idx {kind} file")
    dims = tuple(int.from_bytes(raw[4 * i: 4 * i + 4], "big") for i in range(1, 1 + ndim))
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise ValueError(f"{path}: header says {dims} → {expected} bytes, file has {len(raw)}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load_mnist(root: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read MNIST from the four standard idx files in ``root`` (raw or ``.gz``).

    Files: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
    ``t10k-labels-idx1-ubyte`` (each may end in ``.gz``; the dotted spelling ``…-images.idx3-ubyte`` is
    also accepted). ``root/MNIST/raw`` (torchvision's layout) is searched after ``root``.
    Checks the magic numbers (2051 images, 2049 labels), that each file's size matches its header, and
    that image and label counts agree.

    Returns ``(train_x, train_y, test_x, test_y)``: x float32 (n, 28, 28) = pixel / 255 in [0, 1],
    y int64 (n,).
    """
    root = Path(root)
    folders = [root, root / "MNIST" / "raw"]
    paths = {key: _find_idx(folders, name) for key, name in _MNIST_FILES.items()}
    missing = [_MNIST_FILES[key] for key, path in paths.items() if path is None]
    if missing:
        where = "the folder does not exist" if not root.is_dir() else "missing: " + ", ".join(missing)
        raise FileNotFoundError(
            f"MNIST not found in {root} ({where}). Put train-images-idx3-ubyte, train-labels-idx1-ubyte, "
            f"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (raw or .gz) into {root}/."
        )
    out: list[torch.Tensor] = []
    for split in ("train", "test"):
        images = _read_idx(paths[f"{split}_images"], _IDX_IMAGES_MAGIC)
        labels = _read_idx(paths[f"{split}_labels"], _IDX_LABELS_MAGIC)
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"{paths[f'{split}_images']} has {images.shape[0]} images but "
                f"{paths[f'{split}_labels']} has {labels.shape[0]} labels"
            )
        out.append(torch.from_numpy(images.astype(np.float32) / np.float32(255.0)))
        out.append(torch.from_numpy(labels.astype(np.int64)))
    return out[0], out[1], out[2], out[3]


# --------------------------------------------------------------------------------------------------
# Barcode-MNIST (seed 003, Appendix B)
# --------------------------------------------------------------------------------------------------

#: (number of barcodes, examples per class) for each frequency group, most frequent first. Every barcode
#: yields one class per MNIST digit, so the groups hold 10, 20, 100 and 200 classes of 1777, 100, 20 and
#: 10 examples: n = 17770 + 2000 + 2000 + 2000 = 23770 and c = 330 (seed 003, App. B). See
#: :func:`make_barcode_mnist` for how this split was reconstructed.
BARCODE_MNIST_GROUPS: tuple[tuple[int, int], ...] = ((1, 1777), (2, 100), (10, 20), (20, 10))


def barcode_mnist_class_sizes(
    groups: Sequence[tuple[int, int]] = BARCODE_MNIST_GROUPS, num_digits: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class example counts and group ids implied by ``groups``: two int64 tensors of length c.

    Class ``10·b + d`` (with ``num_digits = 10``) is digit d carrying the b-th barcode; barcodes are
    numbered across groups in order, so classes are sorted from most to least frequent group.
    """
    _check_groups(groups)
    sizes, group_ids = [], []
    for g, (num_barcodes, per_class) in enumerate(groups):
        sizes += [per_class] * (num_barcodes * num_digits)
        group_ids += [g] * (num_barcodes * num_digits)
    return torch.tensor(sizes, dtype=torch.int64), torch.tensor(group_ids, dtype=torch.int64)


def _check_groups(groups: Sequence[tuple[int, int]]) -> None:
    if len(groups) == 0:
        raise ValueError("groups must hold at least one (num_barcodes, examples_per_class) pair")
    for g, pair in enumerate(groups):
        if len(pair) != 2 or any(int(v) != v or v < 1 for v in pair):
            raise ValueError(f"groups[{g}] must be (num_barcodes ≥ 1, examples_per_class ≥ 1), got {pair}")


def _as_generator(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a torch.Generator or an int >= 0, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def make_barcode_mnist(
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    groups: Sequence[tuple[int, int]] = BARCODE_MNIST_GROUPS,
    bits: int = 10,
    seed: int | torch.Generator = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build heavy-tailed Barcode-MNIST from MNIST images (seed 003, App. B; Kunstner et al. 2024, A2).

    Seed 003: "modified from MNIST with additional classes [that] consist of examples of original MNIST
    image plus a 10-bit number encoded in the corner of the image … we subsample examples from classes
    to make the labels heavy-tail imbalanced … n = 23770 images and c = 330 classes", and one frequency
    group "has 200 classes with 10 samples each".

    Construction. A class is a pair (barcode, digit). The barcode is a ``bits``-bit number written in
    the top-left corner: pixel ``[0, j]`` is set to bit ``bits-1-j`` (most significant bit left), i.e.
    to 1.0 or 0.0. Barcode 0 is the plain MNIST digit (the top row of MNIST is blank, so writing zeros
    leaves real digits unchanged): its classes are the original 10 MNIST classes. ``groups`` lists, most
    frequent first, ``(num_barcodes, examples_per_class)``; the first barcode of the first group is 0
    and the others are distinct non-zero numbers drawn with the ``seed`` generator. Each class (b, d)
    receives ``examples_per_class`` images of digit d drawn without replacement from ``images`` (the
    same source image may appear under several barcodes, as in Kunstner et al.'s construction).

    Resolved ambiguities (the appendix gives only n, c and the 200×10 group):
      * class counts per group come in multiples of 10 (one class per digit per barcode);
      * the barcoded groups hold equal totals (2000 examples each), mirroring §3's synthetic data
        where every frequency group holds the same number of examples (1024), and there are four
        groups, matching the four per-frequency panels (c)–(f) of Figure 3; the plain-MNIST group takes
        the rest: 23770 − 3·2000 = 17770 = 10 × 1777. Hence the default
        ``((1, 1777), (2, 100), (10, 20), (20, 10))``: 10, 20, 100, 200 classes of 1777, 100, 20, 10.
        This split is a reconstruction, not unique (``((1, 1777), (4, 50), (8, 25), (20, 10))`` fits
        the same constraints); pass ``groups`` to use another.
      * Barcode values are random distinct non-zero numbers rather than 1, 2, 3, … so all ``bits``
        pixels are used.

    Args:
        images: (n, H, W) float in [0, 1] (e.g. ``load_mnist(...)[0]``), W ≥ ``bits``.
        labels: (n,) integer digit labels; the distinct values are the digits (10 for MNIST).
        groups: see above; every digit needs at least ``max(examples_per_class)`` source images.
        bits: barcode width; at most ``2**bits`` barcodes in total.
        seed: the only source of randomness (barcode values, then example draws, in class order): a
            ``torch.Generator`` (advanced in place) or an int seeding a fresh private generator.

    Returns:
        ``(x, y, class_groups)``: x float32 (N, H, W), y int64 (N,) sorted by class (class
        ``num_digits·b + d`` for the b-th barcode, digit rank d), and class_groups int64 (c,) with the
        frequency-group index (0 = most frequent) of every class.
    """
    _check_groups(groups)
    generator = _as_generator(seed)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"images must be (n, H, W) and labels (n,) with the same n, got {tuple(images.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if not 1 <= bits <= images.shape[2]:
        raise ValueError(f"bits must lie in 1..{images.shape[2]} (the image width), got {bits}")
    total_barcodes = sum(int(b) for b, _ in groups)
    if total_barcodes > 2**bits:
        raise ValueError(f"groups need {total_barcodes} barcodes but {bits} bits give only {2**bits}")

    digits = torch.unique(labels)
    pools = [torch.nonzero(labels == d).flatten() for d in digits]
    need = max(int(s) for _, s in groups)
    short = [int(d) for d, pool in zip(digits, pools) if pool.numel() < need]
    if short:
        raise ValueError(f"digits {short} have fewer than {need} source images (examples_per_class)")

    # Barcode 0 (plain MNIST) first, then distinct random non-zero codes.
    extra = torch.randperm(2**bits - 1, generator=generator)[: total_barcodes - 1] + 1
    codes = torch.cat([torch.zeros(1, dtype=torch.int64), extra])
    shifts = torch.arange(bits - 1, -1, -1)
    code_bits = ((codes[:, None] >> shifts) & 1).to(torch.float32)  # (barcodes, bits), MSB first

    _, class_groups = barcode_mnist_class_sizes(groups, num_digits=len(digits))
    xs, ys = [], []
    barcode = 0
    for num_barcodes, per_class in groups:
        for _ in range(num_barcodes):
            for rank, pool in enumerate(pools):
                chosen = pool[torch.randperm(pool.numel(), generator=generator)[:per_class]]
                x = images[chosen].to(torch.float32).clone()
                x[:, 0, :bits] = code_bits[barcode]
                xs.append(x)
                ys.append(torch.full((per_class,), barcode * len(digits) + rank, dtype=torch.int64))
            barcode += 1
    return torch.cat(xs), torch.cat(ys), class_groups


# --------------------------------------------------------------------------------------------------
# Text: SNLI (jsonl), QNLI (GLUE tsv), Penn Treebank (ptb.*.txt), E2E NLG (csv)
# --------------------------------------------------------------------------------------------------

#: SNLI's gold labels, in the order Hugging Face's ``snli`` uses (0 entailment, 1 neutral, 2 contradiction).
SNLI_LABELS: tuple[str, ...] = ("entailment", "neutral", "contradiction")
#: QNLI's labels (GLUE): 0 entailment, 1 not_entailment.
QNLI_LABELS: tuple[str, ...] = ("entailment", "not_entailment")

SentencePairs = tuple[list[str], list[str], list[int]]


def _folder_with(root: str | Path, names: Sequence[str], subfolders: Sequence[str]) -> Path:
    """The first of ``root`` and ``root/<subfolder>`` that holds every file in ``names`` (else ``root``)."""
    root = Path(root)
    for folder in (root, *(root / s for s in subfolders)):
        if all((folder / name).is_file() for name in names):
            return folder
    return root


def _require_files(folder: Path, names: Sequence[str], dataset: str, source: str) -> None:
    """FileNotFoundError naming the missing files, the folder searched and where the files come from."""
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        where = "the folder does not exist" if not folder.is_dir() else "missing: " + ", ".join(missing)
        raise FileNotFoundError(f"{dataset} not found in {folder} ({where}). Put {', '.join(names)} into {folder}/; "
                                f"they come from {source}.")


def load_snli(root: str | Path) -> dict[str, SentencePairs]:
    """SNLI 1.0 (Bowman et al. 2015) from the jsonl files of ``snli_1.0.zip`` (the Stanford NLP release).

    ``root`` is the ``snli_1.0`` folder or its parent; it must hold ``snli_1.0_train.jsonl``,
    ``snli_1.0_dev.jsonl`` and ``snli_1.0_test.jsonl``: one JSON object per line with (among others)
    ``sentence1`` (premise), ``sentence2`` (hypothesis) and ``gold_label`` (``entailment``, ``neutral``,
    ``contradiction``, or ``-`` when the annotators reached no consensus). Pairs labelled ``-`` have no
    gold label and are left out, as in the paper's splits (550,152 / 10,000 / 10,000 lines give 549,367 /
    9,842 / 9,824 labelled pairs); every other line is kept. Returns ``{"train" | "dev" | "test":
    (premises, hypotheses, labels)}`` with labels indexing :data:`SNLI_LABELS`.
    """
    names = [f"snli_1.0_{split}.jsonl" for split in ("train", "dev", "test")]
    folder = _folder_with(root, names, ["snli_1.0"])
    _require_files(folder, names, "SNLI", "snli_1.0.zip of the Stanford NLP group's SNLI page (extract it)")
    out = {}
    for split, name in zip(("train", "dev", "test"), names):
        premises, hypotheses, labels = [], [], []
        with open(folder / name, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    label, premise, hypothesis = row["gold_label"], row["sentence1"], row["sentence2"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise ValueError(f"{folder / name}, line {number}: not an SNLI record with gold_label, sentence1 "
                                     f"and sentence2 ({type(error).__name__}: {error})") from error
                if label == "-":
                    continue
                if label not in SNLI_LABELS or not isinstance(premise, str) or not isinstance(hypothesis, str):
                    raise ValueError(f"{folder / name}, line {number}: gold_label {label!r} is not one of "
                                     f"{', '.join(SNLI_LABELS)} or '-', or a sentence is not text")
                premises.append(premise)
                hypotheses.append(hypothesis)
                labels.append(SNLI_LABELS.index(label))
        out[split] = (premises, hypotheses, labels)
    return out


def load_qnli(root: str | Path) -> dict[str, SentencePairs]:
    """QNLI from the GLUE benchmark's tsv files (``QNLI.zip`` of the GLUE data; Wang et al. 2019).

    ``root`` is the ``QNLI`` folder or its parent; it must hold ``train.tsv`` and ``dev.tsv`` (GLUE's
    ``test.tsv`` has no labels and is not read). Each file is tab-separated with the header
    ``index	question	sentence	label`` and one pair per line, labels ``entailment`` or
    ``not_entailment``; fields are not quoted. Returns ``{"train" | "dev": (questions, sentences, labels)}``
    with labels indexing :data:`QNLI_LABELS` (GLUE: 104,743 train and 5,463 dev pairs).
    """
    names = ["train.tsv", "dev.tsv"]
    folder = _folder_with(root, names, ["QNLI", "glue_data/QNLI"])
    _require_files(folder, names, "QNLI", "QNLI.zip of the GLUE benchmark data (extract it)")
    out = {}
    for split, name in zip(("train", "dev"), names):
        lines = (folder / name).read_text(encoding="utf-8").split("\n")
        header = lines[0].rstrip("\r").split("\t")
        if [h.strip() for h in header] != ["index", "question", "sentence", "label"]:
            raise ValueError(f"{folder / name}: header must be index, question, sentence, label (tab-separated), "
                             f"got {header}")
        questions, sentences, labels = [], [], []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            cells = line.rstrip("\r").split("\t")
            if len(cells) != 4 or cells[3] not in QNLI_LABELS:
                raise ValueError(f"{folder / name}, line {number}: expected 4 tab-separated fields ending in "
                                 f"{' or '.join(QNLI_LABELS)}, got {len(cells)} field(s)")
            questions.append(cells[1])
            sentences.append(cells[2])
            labels.append(QNLI_LABELS.index(cells[3]))
        out[split] = (questions, sentences, labels)
    return out


def load_ptb(root: str | Path) -> dict[str, list[list[str]]]:
    """Penn Treebank as distributed for language modelling (Mikolov et al.'s ``simple-examples.tgz``).

    ``root`` holds ``ptb.train.txt``, ``ptb.valid.txt`` and ``ptb.test.txt`` (or is the folder whose
    ``simple-examples/data`` holds them): one sentence per line, tokens separated by spaces, already
    lower-cased, numbers as ``N``, rare words as ``<unk>`` (10,000 word types). Returns ``{"train" | "valid"
    | "test": sentences}``, each sentence its tokens followed by ``<eos>`` (the usual end-of-line token;
    929,589 / 73,760 / 82,430 tokens with it). Empty lines are kept as a lone ``<eos>``, so nothing is lost.
    """
    names = ["ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"]
    folder = _folder_with(root, names, ["simple-examples/data", "data"])
    _require_files(folder, names, "Penn Treebank", "simple-examples.tgz of Mikolov's RNNLM toolkit (its "
                   "simple-examples/data folder) or any PTB language-modelling copy with these names")
    out = {}
    for split, name in zip(("train", "valid", "test"), names):
        try:
            text = (folder / name).read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{folder / name}: not UTF-8 text ({error})") from error
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline ends the last sentence; it does not start another
        out[split] = [line.split() + ["<eos>"] for line in lines]
    return out


def load_e2e(root: str | Path) -> dict[str, tuple[list[str], list[str]]]:
    """The E2E NLG Challenge data (Novikova et al. 2017), from the csv files of its public release.

    ``root`` holds ``trainset.csv`` and ``devset.csv`` (or is the parent of the release's ``e2e-dataset``
    folder): comma-separated with a header ``mr,ref`` and quoted fields; ``mr`` is the meaning
    representation (``name[The Eagle], eatType[coffee shop], ...``), ``ref`` one human-written reference
    text. Returns ``{"train" | "dev": (meaning representations, references)}`` (42,061 and 4,672 rows).
    """
    import csv

    names = ["trainset.csv", "devset.csv"]
    folder = _folder_with(root, names, ["e2e-dataset"])
    _require_files(folder, names, "E2E NLG", "the E2E NLG Challenge dataset release (e2e-dataset: trainset.csv, "
                   "devset.csv)")
    out = {}
    for split, name in zip(("train", "dev"), names):
        with open(folder / name, encoding="utf-8", newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if header is None or [h.strip().lstrip("\ufeff") for h in header] != ["mr", "ref"]:
                raise ValueError(f"{folder / name}: header must be mr,ref, got {header}")
            mrs, refs = [], []
            for number, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) != 2:
                    raise ValueError(f"{folder / name}, row {number}: expected 2 fields (mr, ref), got {len(row)}")
                mrs.append(row[0])
                refs.append(row[1])
        out[split] = (mrs, refs)
    return out
