"""Loaders read tiny files written in the datasets' real formats; Barcode-MNIST has the appendix's shape."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fed_dp.simulations.tasks.datasets import (
    BARCODE_MNIST_GROUPS,
    barcode_mnist_class_sizes,
    load_cifar10,
    load_mnist,
    make_barcode_mnist,
)

# ---------------------------------------------------------------------------------------------- CIFAR


def _write_cifar_batch(path: Path, data: np.ndarray, labels: list[int], *, numpy1_names: bool = False) -> None:
    """A batch as the python-version tarball ships it: dict with bytes keys, uint8 (n, 3072), label list."""
    blob = pickle.dumps({b"batch_label": b"test", b"labels": labels, b"data": data, b"filenames": []}, protocol=2)
    if numpy1_names:  # what a file pickled under numpy < 2 (the original tarball) references
        assert b"numpy._core.multiarray\n" in blob
        blob = blob.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    path.write_bytes(blob)


def _cifar_files(folder: Path, rows: list[int], seed: int = 0, **kw) -> list[tuple[np.ndarray, list[int]]]:
    """Writes data_batch_1..5 and test_batch with the given row counts; returns what was written."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = []
    for name, n in zip([*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"], rows):
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        _write_cifar_batch(folder / name, data, labels, **kw)
        written.append((data, labels))
    return written


def _expected_image(row: np.ndarray, c: int, i: int, j: int) -> float:
    # Row layout: 1024 red, then 1024 green, then 1024 blue; each plane is row-major 32×32.
    return row[c * 1024 + i * 32 + j] / 255.0


@pytest.mark.parametrize("numpy1_names", [False, True])
def test_cifar10_returns_exact_pixels_and_labels(tmp_path, numpy1_names):
    rows = [3, 2, 4, 1, 2, 5]  # few rows, and not the same per batch: nothing assumes 10000
    written = _cifar_files(tmp_path / "cifar-10-batches-py", rows, numpy1_names=numpy1_names)
    train_x, train_y, test_x, test_y = load_cifar10(tmp_path)

    assert train_x.shape == (12, 3, 32, 32) and train_x.dtype == torch.float32
    assert test_x.shape == (5, 3, 32, 32)
    assert train_y.dtype == torch.int64 and test_y.dtype == torch.int64
    train_rows = np.concatenate([d for d, _ in written[:5]])
    train_labels = sum((l for _, l in written[:5]), [])
    assert train_y.tolist() == train_labels
    assert test_y.tolist() == written[5][1]
    for k, (c, i, j) in enumerate([(0, 0, 0), (1, 5, 7), (2, 31, 30), (0, 17, 3), (2, 0, 31)]):
        n = k % 12
        assert train_x[n, c, i, j].item() == pytest.approx(_expected_image(train_rows[n], c, i, j))
    expected_test = torch.from_numpy(written[5][0].astype(np.float32) / 255.0).reshape(5, 3, 32, 32)
    torch.testing.assert_close(test_x, expected_test, rtol=0, atol=0)
    assert 0.0 <= float(train_x.min()) and float(train_x.max()) <= 1.0


def test_cifar10_root_may_be_the_batches_folder_itself(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar_files(folder, [1] * 6)
    a = load_cifar10(folder)
    b = load_cifar10(tmp_path)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_cifar10_missing_folder_names_the_files_to_put_there(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_cifar10(tmp_path / "nowhere")
    msg = str(e.value)
    assert "data_batch_1" in msg and "data_batch_5" in msg and "test_batch" in msg
    assert "cifar-10-python.tar.gz" in msg and str(tmp_path / "nowhere" / "cifar-10-batches-py") in msg


def test_cifar10_missing_file_is_named(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar_files(folder, [1] * 6)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing: data_batch_3\b"):
        load_cifar10(tmp_path)


def test_cifar10_malformed_batch_is_named(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar_files(folder, [1] * 6)
    _write_cifar_batch(folder / "data_batch_2", np.zeros((2, 100), dtype=np.uint8), [0, 1])
    with pytest.raises(ValueError, match="data_batch_2.*3072"):
        load_cifar10(tmp_path)


def test_cifar10_refuses_pickles_that_reference_other_globals(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar_files(folder, [1] * 6)
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": Path("x"), b"labels": [0]}, protocol=2))
    with pytest.raises(ValueError, match="test_batch.*refusing"):
        load_cifar10(tmp_path)


# ---------------------------------------------------------------------------------------------- MNIST


def _idx_images(images: np.ndarray, magic: int = 2051) -> bytes:
    n, r, c = images.shape
    return struct.pack(">iiii", magic, n, r, c) + images.astype(np.uint8).tobytes()


def _idx_labels(labels: np.ndarray, magic: int = 2049) -> bytes:
    return struct.pack(">ii", magic, len(labels)) + labels.astype(np.uint8).tobytes()


def _mnist_files(folder: Path, n_train: int = 7, n_test: int = 4, gz: bool = False, seed: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "train": (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8), rng.integers(0, 10, n_train)),
        "test": (rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8), rng.integers(0, 10, n_test)),
    }
    names = {"train": "train", "test": "t10k"}
    for split, (images, labels) in arrays.items():
        for suffix, blob in (("images-idx3-ubyte", _idx_images(images)), ("labels-idx1-ubyte", _idx_labels(labels))):
            name = f"{names[split]}-{suffix}"
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(blob))
            else:
                (folder / name).write_bytes(blob)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_returns_exact_pixels_and_labels(tmp_path, gz):
    arrays = _mnist_files(tmp_path, gz=gz)
    train_x, train_y, test_x, test_y = load_mnist(tmp_path)
    for (x, y), split in (((train_x, train_y), "train"), ((test_x, test_y), "test")):
        images, labels = arrays[split]
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape == images.shape
        assert y.tolist() == labels.tolist()
        # pixel (k, i, j) is byte 16 + k·784 + i·28 + j of the file: row-major rows of 28
        assert x[1, 3, 20].item() == pytest.approx(images[1, 3, 20] / 255.0)
        assert x[0, 27, 0].item() == pytest.approx(images[0, 27, 0] / 255.0)
        torch.testing.assert_close(x, torch.from_numpy(images.astype(np.float32) / 255.0), rtol=0, atol=0)


def test_mnist_missing_folder_and_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_mnist(tmp_path / "nowhere")
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        assert name in str(e.value)
    _mnist_files(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing: t10k-labels-idx1-ubyte$|missing: t10k-labels-idx1-ubyte\)"):
        load_mnist(tmp_path)


def test_mnist_bad_magic_number_names_the_file(tmp_path):
    _mnist_files(tmp_path)
    images = np.zeros((7, 28, 28), dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(_idx_images(images, magic=2049))
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: bad magic number 2049, expected 2051"):
        load_mnist(tmp_path)


def test_mnist_bad_magic_in_gz_labels_and_truncated_file(tmp_path):
    _mnist_files(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_labels(np.zeros(4), magic=2051)))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: bad magic number 2051, expected 2049"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_labels(np.zeros(4))[:-1]))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte\.gz: header says"):
        load_mnist(tmp_path)


def test_mnist_image_and_label_counts_must_agree(tmp_path):
    _mnist_files(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_labels(np.zeros(6)))
    with pytest.raises(ValueError, match="7 images but .*6 labels"):
        load_mnist(tmp_path)


# -------------------------------------------------------------------------------------- Barcode-MNIST


def _fake_mnist(per_digit: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Digit-like images with a blank top row (as in MNIST), `per_digit` of each digit, shuffled."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(10).repeat_interleave(per_digit)
    y = y[torch.randperm(len(y), generator=g)]
    x = torch.rand(len(y), 28, 28, generator=g)
    x[:, 0, :] = 0.0
    return x, y


def _decode(x: torch.Tensor, bits: int = 10) -> torch.Tensor:
    weights = 2 ** torch.arange(bits - 1, -1, -1)
    return (x[:, 0, :bits].round().long() * weights).sum(1)


def test_default_barcode_mnist_matches_appendix_b_totals():
    """Seed 003 App. B: n = 23770, c = 330, and a group of 200 classes with 10 examples each."""
    x, y = _fake_mnist(per_digit=1800)
    bx, by, groups = make_barcode_mnist(x, y, seed=torch.Generator().manual_seed(1))
    assert bx.shape == (23770, 28, 28) and by.shape == (23770,)
    assert groups.shape == (330,)
    counts = torch.bincount(by, minlength=330)
    # independent expectation: class 10·b + d, barcodes 0 | 1–2 | 3–12 | 13–32
    expected_counts, expected_groups = [], []
    for g, (first, last, size) in enumerate([(0, 0, 1777), (1, 2, 100), (3, 12, 20), (13, 32, 10)]):
        for _ in range(10 * (last - first + 1)):
            expected_counts.append(size)
            expected_groups.append(g)
    assert counts.tolist() == expected_counts
    assert groups.tolist() == expected_groups
    assert int((counts == 10).sum()) == 200
    assert [int((groups == g).sum()) for g in range(4)] == [10, 20, 100, 200]
    sizes, group_ids = barcode_mnist_class_sizes()
    assert sizes.tolist() == expected_counts and group_ids.tolist() == expected_groups
    assert BARCODE_MNIST_GROUPS == ((1, 1777), (2, 100), (10, 20), (20, 10))


def test_barcode_mnist_examples_are_source_digits_with_their_barcode():
    x, y = _fake_mnist(per_digit=8)
    groups = ((1, 6), (2, 3), (3, 1))
    bx, by, class_groups = make_barcode_mnist(x, y, groups=groups, seed=5)
    assert bx.shape == (10 * (6 + 2 * 3 + 3 * 1), 28, 28)
    assert class_groups.tolist() == [0] * 10 + [1] * 20 + [2] * 30
    codes = _decode(bx)
    barcode_of_class = {}
    for img, label, code in zip(bx, by.tolist(), codes.tolist()):
        barcode_index, digit = divmod(label, 10)
        # same barcode for every example of a class; barcode 0 (plain digits) for classes 0..9
        assert barcode_of_class.setdefault(barcode_index, code) == code
        # the rest of the image is an unmodified source image of that digit
        matches = [k for k in torch.nonzero(y == digit).flatten().tolist()
                   if torch.equal(x[k, 1:], img[1:]) and torch.equal(x[k, 0, 10:], img[0, 10:])]
        assert matches, f"example of class {label} is not a digit-{digit} source image"
        assert set(img[0, :10].tolist()) <= {0.0, 1.0}
    assert barcode_of_class[0] == 0
    assert len(set(barcode_of_class.values())) == 6  # distinct barcodes
    # within a class, the source images are distinct (drawn without replacement)
    for c in range(10):
        members = bx[by == c]
        assert len({tuple(m.flatten().tolist()) for m in members}) == 6


def test_barcode_mnist_is_deterministic_per_seed_and_varies_across_seeds():
    x, y = _fake_mnist(per_digit=5)
    groups = ((1, 4), (3, 2))
    a = make_barcode_mnist(x, y, groups=groups, seed=torch.Generator().manual_seed(3))
    b = make_barcode_mnist(x, y, groups=groups, seed=torch.Generator().manual_seed(3))
    c = make_barcode_mnist(x, y, groups=groups, seed=torch.Generator().manual_seed(4))
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], c[0])
    assert torch.equal(a[1], c[1]) and torch.equal(a[2], c[2])  # labels and groups do not depend on the seed
    assert torch.equal(make_barcode_mnist(x, y, groups=groups, seed=3)[0], a[0])  # int seed ≡ Generator seed


def test_barcode_mnist_rejects_impossible_requests():
    x, y = _fake_mnist(per_digit=3)
    with pytest.raises(ValueError, match="fewer than 4 source images"):
        make_barcode_mnist(x, y, groups=((1, 4),), seed=0)
    with pytest.raises(ValueError, match="barcodes"):
        make_barcode_mnist(x, y, groups=((5, 1),), bits=2, seed=0)
    with pytest.raises(ValueError, match=r"groups\[0\]"):
        make_barcode_mnist(x, y, groups=((0, 1),), seed=0)
    with pytest.raises(ValueError, match="seed"):
        make_barcode_mnist(x, y, groups=((1, 1),), seed=-1)


# ------------------------------------------------------------------------------ text: SNLI, QNLI, PTB, E2E

from data_fixtures import E2E_ROWS, PTB_LINES, QNLI_ROWS, SNLI_ROWS, write_e2e, write_ptb, write_qnli, write_snli  # noqa: E402

from fed_dp.simulations.tasks.datasets import QNLI_LABELS, SNLI_LABELS, load_e2e, load_ptb, load_qnli, load_snli  # noqa: E402


def test_snli_reads_every_labelled_pair_and_leaves_out_no_consensus(tmp_path):
    write_snli(tmp_path)
    data = load_snli(tmp_path)  # the parent of snli_1.0/
    kept = [row for row in SNLI_ROWS if row[0] != "-"]
    for split in ("train", "dev", "test"):
        premises, hypotheses, labels = data[split]
        assert premises == [r[1] for r in kept] and hypotheses == [r[2] for r in kept]
        assert [SNLI_LABELS[i] for i in labels] == [r[0] for r in kept]
    assert load_snli(tmp_path / "snli_1.0")["train"] == data["train"]  # or the folder itself


def test_snli_errors_name_the_files_and_the_line(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_snli(tmp_path / "nowhere")
    assert "snli_1.0_train.jsonl" in str(error.value) and "snli_1.0.zip" in str(error.value)
    folder = write_snli(tmp_path)
    (folder / "snli_1.0_dev.jsonl").write_text('{"gold_label": "neutral", "sentence1": "a", "sentence2": "b"}\n'
                                               '{"gold_label": "maybe", "sentence1": "a", "sentence2": "b"}\n')
    with pytest.raises(ValueError, match=r"snli_1.0_dev.jsonl, line 2: gold_label 'maybe'"):
        load_snli(tmp_path)
    (folder / "snli_1.0_dev.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"snli_1.0_dev.jsonl, line 1"):
        load_snli(tmp_path)


def test_qnli_reads_glue_tsv(tmp_path):
    write_qnli(tmp_path)
    data = load_qnli(tmp_path)
    for split in ("train", "dev"):
        questions, sentences, labels = data[split]
        assert questions == [r[0] for r in QNLI_ROWS] and sentences == [r[1] for r in QNLI_ROWS]
        assert [QNLI_LABELS[i] for i in labels] == [r[2] for r in QNLI_ROWS]
    with pytest.raises(FileNotFoundError, match="train.tsv.*GLUE"):
        load_qnli(tmp_path / "nowhere")
    (tmp_path / "QNLI" / "dev.tsv").write_text("index\tquestion\tsentence\tlabel\n0\tq\ts\tyes\n")
    with pytest.raises(ValueError, match=r"dev.tsv, line 2"):
        load_qnli(tmp_path)
    (tmp_path / "QNLI" / "dev.tsv").write_text("idx\tq\n")
    with pytest.raises(ValueError, match="header"):
        load_qnli(tmp_path)


def test_ptb_lines_are_sentences_ending_in_eos(tmp_path):
    write_ptb(tmp_path / "simple-examples" / "data")
    data = load_ptb(tmp_path)
    for split in ("train", "valid", "test"):
        assert data[split] == [line.split() + ["<eos>"] for line in PTB_LINES]
    assert sum(len(s) for s in data["train"]) == sum(len(line.split()) + 1 for line in PTB_LINES)
    with pytest.raises(FileNotFoundError, match="ptb.train.txt.*simple-examples"):
        load_ptb(tmp_path / "nowhere")


def test_e2e_reads_quoted_csv_fields(tmp_path):
    write_e2e(tmp_path)
    data = load_e2e(tmp_path)
    for split in ("train", "dev"):
        assert data[split] == ([r[0] for r in E2E_ROWS], [r[1] for r in E2E_ROWS])  # commas, quotes, newlines kept
    with pytest.raises(FileNotFoundError, match="trainset.csv.*E2E"):
        load_e2e(tmp_path / "nowhere")
    (tmp_path / "devset.csv").write_text("mr,ref\na,b,c\n")
    with pytest.raises(ValueError, match=r"devset.csv, row 2: expected 2 fields"):
        load_e2e(tmp_path)
