"""Federated datasets with natural users, read from tiny files in their published layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data_fixtures import FLAIR_LABELS, STACKOVERFLOW_CLIENTS, write_femnist, write_flair, write_shakespeare, write_stackoverflow

from fed_dp.simulations.tasks import federated_datasets as fd


def test_leaf_reads_every_user_of_every_file_in_order(tmp_path):
    train, test = write_femnist(tmp_path)
    got_train, got_test = fd.load_leaf(tmp_path, "femnist")
    assert list(got_train) == list(train) and got_train == train and got_test == test
    roles_train, _ = write_shakespeare(tmp_path / "shakespeare")
    assert fd.load_leaf(tmp_path / "shakespeare", "shakespeare")[0] == roles_train


def test_leaf_errors_name_the_folder_file_and_user(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        fd.load_leaf(tmp_path / "nowhere", "femnist")
    assert "train" in str(error.value) and "preprocess.sh" in str(error.value)
    write_femnist(tmp_path)
    bad = tmp_path / "train" / "all_data_1_niid_0_keep_0_train_9.json"
    document = json.loads(bad.read_text())
    document["num_samples"][0] += 1
    bad.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="user 'f0002_07' has 4 x, 4 y and num_samples 5"):
        fd.load_leaf(tmp_path, "femnist")
    document["num_samples"][0] -= 1
    document["users"] = ["f0000_14"]
    document["user_data"] = {"f0000_14": document["user_data"]["f0002_07"]}
    bad.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="f0000_14.*appears in two train files"):
        fd.load_leaf(tmp_path, "femnist")
    bad.write_text("{")
    with pytest.raises(ValueError, match="not a LEAF json file"):
        fd.load_leaf(tmp_path, "femnist")


def test_stackoverflow_clients_sentences_and_word_counts(tmp_path):
    write_stackoverflow(tmp_path)
    path, ids = fd.stackoverflow_users(tmp_path, "train")
    assert ids == sorted(STACKOVERFLOW_CLIENTS)
    for client, sentences in STACKOVERFLOW_CLIENTS.items():
        assert fd.stackoverflow_sentences(path, client) == [s.split() for s in sentences]
    counts = fd.read_word_counts(tmp_path / "stackoverflow.word_count")
    lines = (tmp_path / "stackoverflow.word_count").read_text().splitlines()
    assert counts == [(line.split("\t")[0], int(line.split("\t")[1])) for line in lines]
    assert sum(c for _, c in counts) == sum(len(s.split()) for ss in STACKOVERFLOW_CLIENTS.values() for s in ss)


def test_stackoverflow_missing_or_wrong_files(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        fd.stackoverflow_users(tmp_path / "nowhere")
    assert "stackoverflow_train.h5" in str(error.value) and "stackoverflow.tar.bz2" in str(error.value)
    write_stackoverflow(tmp_path)
    (tmp_path / "stackoverflow.word_count").write_text("python many\n")
    with pytest.raises(ValueError, match="line 1: expected 'word count'"):
        fd.read_word_counts(tmp_path / "stackoverflow.word_count")
    other = tmp_path / "other"
    write_stackoverflow(other)
    (other / "stackoverflow_train.h5").write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match="not an hdf5 file"):
        fd.stackoverflow_users(other)


def test_flair_users_images_and_multi_hot_labels(tmp_path):
    written = write_flair(tmp_path)
    assert fd.flair_labels(tmp_path) == sorted(FLAIR_LABELS)
    path, ids = fd.flair_users(tmp_path, "train")
    assert sorted(ids) == sorted(u for s, u in written if s == "train")
    for (split, user), (images, labels) in written.items():
        x, y = fd.flair_user(path, split, user, sorted(FLAIR_LABELS), 32)
        # each 32x32 pixel is the mean of a 2x2 block of the 64x64 image, channels first, in [0, 1]
        block = images[:, :2, :2, :].astype(np.float64).mean(axis=(1, 2)) / 255.0
        torch.testing.assert_close(x[:, :, 0, 0], torch.from_numpy(block).float())
        assert x.shape == (len(images), 3, 32, 32)
        full, _ = fd.flair_user(path, split, user, sorted(FLAIR_LABELS), 64)
        torch.testing.assert_close(full, torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0)
        expected = [[float(name in entry.split("|")) for name in sorted(FLAIR_LABELS)] for entry in labels]
        assert y.tolist() == expected


def test_flair_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="flair_federated.hdf5.*prepare_dataset.py"):
        fd.flair_labels(tmp_path)
    write_flair(tmp_path)
    with pytest.raises(ValueError, match="no /val group"):
        fd.flair_users(tmp_path, "val")
    path, ids = fd.flair_users(tmp_path, "train")
    with pytest.raises(ValueError, match="not in /metadata/label_counter"):
        fd.flair_user(path, "train", ids[0], ["animal"], 32)
    with pytest.raises(ValueError, match="cannot be reduced to 48x48"):
        fd.flair_user(path, "train", ids[0], sorted(FLAIR_LABELS), 48)


def test_without_h5py_the_error_names_the_install(tmp_path, monkeypatch):
    import sys

    write_stackoverflow(tmp_path)
    fd._open_h5.cache_clear()
    monkeypatch.setitem(sys.modules, "h5py", None)  # what `import h5py` sees when it is not installed
    with pytest.raises(ImportError, match="pip install h5py"):
        fd.stackoverflow_users(tmp_path)
