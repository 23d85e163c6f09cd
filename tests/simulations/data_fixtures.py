"""Tiny copies of the text and federated datasets, written in their exact published formats (the tests make
their own data: nothing is downloaded). Each writer returns what it wrote, so tests compare against the
written values, never against the code under test."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

SNLI_ROWS = [  # (gold_label, sentence1, sentence2)
    ("neutral", "A person on a horse jumps over a broken down airplane.", "A person is training his horse for a competition."),
    ("contradiction", "A person on a horse jumps over a broken down airplane.", "A person is at a diner, ordering an omelette."),
    ("entailment", "Children smiling and waving at camera", "There are children present"),
    ("-", "Two blond women are hugging one another.", "Some women are hugging on vacation."),
    ("entailment", "A boy is jumping on skateboard.", "The boy does a skateboarding trick."),
    ("neutral", "An older man sits with his orange juice.", "A man is drinking juice."),
    ("contradiction", "Two women are embracing.", "The men are fighting outside a deli."),
    ("entailment", "A dog runs, happy.", "An animal runs."),
]


def write_snli(root: Path, rows=SNLI_ROWS) -> Path:
    """``snli_1.0/snli_1.0_{train,dev,test}.jsonl`` as in snli_1.0.zip (every field of a real record)."""
    folder = root / "snli_1.0"
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev", "test"):
        with open(folder / f"snli_1.0_{split}.jsonl", "w", encoding="utf-8") as handle:
            for i, (label, s1, s2) in enumerate(rows):
                record = {"annotator_labels": [label if label != "-" else "neutral"], "captionID": f"{i}.jpg#{i}",
                          "gold_label": label, "pairID": f"{i}.jpg#{i}r1n", "sentence1": s1,
                          "sentence1_binary_parse": "( " + s1 + " )", "sentence1_parse": "(ROOT " + s1 + ")",
                          "sentence2": s2, "sentence2_binary_parse": "( " + s2 + " )",
                          "sentence2_parse": "(ROOT " + s2 + ")"}
                handle.write(json.dumps(record) + "\n")
    return folder


QNLI_ROWS = [  # (question, sentence, label)
    ("When did the third Digimon series begin?", "Unlike the two seasons before it, it was darker.", "not_entailment"),
    ("Which missile batteries often have individual launchers?", "When air defence batteries have launchers, they are spread.", "entailment"),
    ("What two things does Popper argue Tarski's theory involves?", "Popper argues that it involves two things.", "entailment"),
    ("What is the name of the village?", "It lies in the valley, 'far' from the road.", "not_entailment"),
    ("Who wrote it?", "It was written by him in 1901.", "entailment"),
    ("How many?", "Nobody knows; estimates differ.", "not_entailment"),
]


def write_qnli(root: Path, rows=QNLI_ROWS) -> Path:
    """GLUE's ``QNLI/{train,dev,test}.tsv`` (test without labels), tab-separated, unquoted."""
    folder = root / "QNLI"
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev"):
        lines = ["index\tquestion\tsentence\tlabel"] + [f"{i}\t{q}\t{s}\t{l}" for i, (q, s, l) in enumerate(rows)]
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "test.tsv").write_text("index\tquestion\tsentence\n0\tWho?\tHim.\n", encoding="utf-8")
    return folder


PTB_LINES = [
    " aer banknote berlitz calloway centrust cluett fromstein gitano guterman ",
    " pierre <unk> N years old will join the board as a nonexecutive director nov. N ",
    " mr. <unk> is chairman of <unk> n.v. the dutch publishing group ",
    " rudolph <unk> N years old and former chairman was named a director ",
    " a form of asbestos once used to make kent cigarette filters has caused a high percentage ",
    " the asbestos fiber <unk> is unusually <unk> once it enters the <unk> ",
]


def write_ptb(root: Path, lines=PTB_LINES) -> Path:
    """``ptb.{train,valid,test}.txt`` as in simple-examples/data: a leading and a trailing space per line."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("train", "valid", "test"):
        (root / f"ptb.{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


E2E_ROWS = [
    ("name[The Vaults], eatType[pub], priceRange[more than £30], customer rating[5 out of 5], near[Café Adriatic]",
     "The Vaults pub near Café Adriatic has a 5 star rating.  Prices start at £30."),
    ("name[The Cambridge Blue], eatType[pub], food[English], priceRange[cheap], near[Café Brazil]",
     "Close to Café Brazil, The Cambridge Blue pub serves delicious Tuscan Beef for the cheap price of £10.50."),
    ("name[The Eagle], eatType[coffee shop], food[Japanese], priceRange[less than £20]",
     'The Eagle is a "coffee shop", with Japanese food, and prices less than £20.'),
    ("name[The Mill], eatType[coffee shop], food[French], area[riverside]",
     "The Mill, a French coffee shop,\nis by the riverside."),
    ("name[Loch Fyne], food[French], customer rating[high]", "Loch Fyne serves French food."),
    ("name[Bibimbap House], food[English], priceRange[moderate], area[riverside], near[Clare Hall]",
     "Bibimbap House is a moderately priced restaurant near Clare Hall."),
]


def write_e2e(root: Path, rows=E2E_ROWS) -> Path:
    """``trainset.csv`` and ``devset.csv`` of the E2E release: header mr,ref, fields quoted where needed."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("trainset.csv", "devset.csv"):
        with open(root / name, "w", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["mr", "ref"])
            writer.writerows(rows)
    return root


def _leaf_file(path: Path, users: dict[str, tuple[list, list]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"users": list(users), "num_samples": [len(v[1]) for v in users.values()],
                                "hierarchies": [], "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}))


def write_femnist(root: Path, seed: int = 0) -> tuple[dict, dict]:
    """LEAF FEMNIST json: train/ in two files (users f0000_14, f0001_41 | f0002_07), test/ in one; x are 784
    values k/255, y labels in 0..61."""
    rng = np.random.default_rng(seed)

    def user(n: int) -> tuple[list, list]:
        return ((rng.integers(0, 256, (n, 784)) / 255.0).tolist(), rng.integers(0, 62, n).tolist())

    train = {"f0000_14": user(3), "f0001_41": user(2), "f0002_07": user(4)}
    test = {u: user(1) for u in train}
    _leaf_file(root / "train" / "all_data_0_niid_0_keep_0_train_9.json", dict(list(train.items())[:2]))
    _leaf_file(root / "train" / "all_data_1_niid_0_keep_0_train_9.json", dict(list(train.items())[2:]))
    _leaf_file(root / "test" / "all_data_0_niid_0_keep_0_test_9.json", test)
    return train, test


SHAKESPEARE_TEXT = ("FIRST CITIZEN: Before we proceed any further, hear me speak. ALL: Speak, speak. "
                    "FIRST CITIZEN: You are all resolved rather to die than to famish? ALL: Resolved. resolved.")


def write_shakespeare(root: Path) -> tuple[dict, dict]:
    """LEAF Shakespeare json: examples are 80-character windows x and the next character y (stride 1)."""
    def role(start: int, n: int) -> tuple[list, list]:
        text = SHAKESPEARE_TEXT
        return ([text[i : i + 80] for i in range(start, start + n)], [text[i + 80] for i in range(start, start + n)])

    train = {"THE_TRAGEDY_OF_CORIOLANUS_FIRST_CITIZEN": role(0, 4), "THE_TRAGEDY_OF_CORIOLANUS_ALL": role(10, 3)}
    test = {"THE_TRAGEDY_OF_CORIOLANUS_FIRST_CITIZEN": role(20, 2), "THE_TRAGEDY_OF_CORIOLANUS_ALL": role(30, 1)}
    _leaf_file(root / "train" / "all_data_niid_0_keep_0_train_9.json", train)
    _leaf_file(root / "test" / "all_data_niid_0_keep_0_test_9.json", test)
    return train, test


STACKOVERFLOW_CLIENTS = {
    "00000001": ["how do i sort a list in python ?", "use sorted ( ) ."],
    "00000002": ["my code does not compile", "what is the error message ?", "thanks !"],
    "00000010": ["python list comprehension with a condition"],
}


def write_stackoverflow(root: Path, clients=STACKOVERFLOW_CLIENTS) -> Path:
    """TFF's StackOverflow release: stackoverflow_{train,held_out,test}.h5 with /examples/<client>/<feature>
    (tokens, title, tags, score, type, creation_date; strings as bytes) and stackoverflow.word_count."""
    import h5py

    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "held_out", "test"):
        with h5py.File(root / f"stackoverflow_{split}.h5", "w") as handle:
            for client, sentences in clients.items():
                group = handle.create_group(f"examples/{client}")
                n = len(sentences)
                group["tokens"] = np.asarray([s.encode() for s in sentences], dtype="S")
                group["title"] = np.asarray([b"a title"] * n, dtype="S")
                group["tags"] = np.asarray([b"python|list"] * n, dtype="S")
                group["type"] = np.asarray([b"question"] * n, dtype="S")
                group["creation_date"] = np.asarray([b"2010-01-01 00:00:00.000+00:00"] * n, dtype="S")
                group["score"] = np.arange(n, dtype=np.int64)
    counts: dict[str, int] = {}
    for sentences in clients.values():
        for sentence in sentences:
            for word in sentence.split():
                counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))
    (root / "stackoverflow.word_count").write_text("".join(f"{w}\t{c}\n" for w, c in ranked), encoding="utf-8")
    return root


FLAIR_LABELS = ["animal", "equipment", "material", "structure"]


def write_flair(root: Path, size: int = 64, seed: int = 0) -> dict:
    """ml-flair's federated hdf5 (prepare_dataset.py): /<partition>/<user>/{images, labels,
    fine_grained_labels, image_ids}, labels "a|b" byte strings, /metadata/label_counter as a JSON string.
    Images are ``size``×``size`` (256 in FLAIR; 64 here, so the task's reduction to 32×32 is exercised)."""
    import h5py

    rng = np.random.default_rng(seed)
    users = {"train": {"59769174@N00": 2, "10000001@N01": 3}, "test": {"20000002@N02": 2}}
    written = {}
    root.mkdir(parents=True, exist_ok=True)
    with h5py.File(root / "flair_federated.hdf5", "w") as handle:
        counter: dict[str, int] = {}
        for split, members in users.items():
            for user, n in members.items():
                images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
                labels = ["|".join(sorted(rng.choice(FLAIR_LABELS, size=2, replace=False))) for _ in range(n)]
                for entry in labels:
                    for name in entry.split("|"):
                        counter[name] = counter.get(name, 0) + 1
                handle[f"/{split}/{user}/labels"] = np.asarray(labels, dtype="S")
                handle[f"/{split}/{user}/fine_grained_labels"] = np.asarray(["x"] * n, dtype="S")
                handle[f"/{split}/{user}/image_ids"] = np.asarray([str(i) for i in range(n)], dtype="S")
                handle.create_dataset(f"/{split}/{user}/images", data=images)
                written[(split, user)] = (images, labels)
        for name in FLAIR_LABELS:
            counter.setdefault(name, 0)
        handle["/metadata/label_counter"] = json.dumps(counter)
        handle["/metadata/fine_grained_label_counter"] = json.dumps({"x": 1})
    return written


WRITERS = {"snli": write_snli, "qnli": write_qnli, "ptb": write_ptb, "e2e": write_e2e, "femnist": write_femnist,
           "shakespeare": write_shakespeare, "stackoverflow": write_stackoverflow, "flair": write_flair}


def write(name: str, root: Path) -> Path:
    """The fixture of dataset ``name`` under ``root``; returns the folder to give as ``task.root``."""
    WRITERS[name](root)
    return root
