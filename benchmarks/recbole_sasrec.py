"""RecBole 1.2.1's SASRec on the events benchmarks/sequential.py writes, run in RecBole's own
environment (its pins clash with Sampan's: a virtualenv with recbole installed, e.g.
``python -m venv --system-site-packages rb && rb/bin/pip install --no-deps recbole==1.2.1
colorlog==4.7.2 colorama==0.4.4 thop texttable tabulate pandas && rb/bin/pip install
"numpy<2" "pandas<2.3" "scipy<1.14"``: RecBole 1.2.1 uses ``np.float_``, which NumPy 2
removed).

RecBole trains with its own defaults for SASRec (2 layers, 2 heads, hidden 64, inner 256,
dropout 0.5, CE loss, batch 2048, lr 0.001, early stopping after 10 evaluations without
improvement) on the same leave-one-out split. Its test predictions are ranked here the way
Sampan ranks (the number of items scoring at least as high as the right one), and written
per user with the wall times:

    rb/bin/python benchmarks/recbole_sasrec.py EVENTS.tsv OUT.json --max-len 50

``--estimate N`` trains N batches only and writes, instead of ranks, the seconds a batch
and what an epoch would take (RecBole trains every prefix of every sequence, so a long
history costs hours an epoch on a few cores): whether a run fits before starting it.

``--device cuda`` trains on a GPU (``benchmarks/recbole_gpu.sh`` runs it on a GPU machine
without a package index). ``--time-limit S`` ends training after the epoch that passes S
seconds (the result says so). Under NumPy 2 the aliases RecBole 1.2.1 reads (``np.float_``,
``np.complex_``, ``np.unicode_``) are set to the types they named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("events", type=Path, help="TSV: user_id, item_id, timestamp (a header line)")
    p.add_argument("out", type=Path)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--time-limit", type=float, default=0.0, metavar="S",
                   help="end training after the epoch that passes S seconds (0: no limit)")
    p.add_argument("--estimate", type=int, metavar="N", default=0,
                   help="time N training batches (after 2 untimed) and write the estimate "
                   "of an epoch instead of training")
    a = p.parse_args()
    # RecBole reloads its own best checkpoint, written a moment before by this process, with
    # torch.load's pre-2.6 default (full unpickling), which it was written for
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

    import numpy as np
    import torch

    for old, new in (("float_", np.float64), ("complex_", np.complex128), ("unicode_", np.str_)):
        if old not in np.__dict__:  # NumPy 2 removed them; RecBole's Config reads them
            setattr(np, old, new)
    from recbole.config import Config
    from recbole.data import create_dataset, data_preparation
    from recbole.model.sequential_recommender import SASRec
    from recbole.trainer import Trainer
    from recbole.utils import init_seed

    if a.threads:
        torch.set_num_threads(a.threads)
    work = (a.out.parent / "recbole").resolve()
    name = "events"
    (work / name).mkdir(parents=True, exist_ok=True)
    events, a.out = a.events.resolve(), a.out.resolve()
    os.chdir(work)  # RecBole writes its log/ and log_tensorboard/ into the working directory
    lines = events.read_text().splitlines()
    (work / name / f"{name}.inter").write_text(
        "user_id:token\titem_id:token\ttimestamp:float\n" + "\n".join(lines[1:]) + "\n")
    config = Config(model="SASRec", dataset=name, config_dict={
        "data_path": str(work), "checkpoint_dir": str(work / "saved"),
        "USER_ID_FIELD": "user_id", "ITEM_ID_FIELD": "item_id", "TIME_FIELD": "timestamp",
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
        "user_inter_num_interval": "[0,inf)", "item_inter_num_interval": "[0,inf)",
        "MAX_ITEM_LIST_LENGTH": a.max_len, "train_neg_sample_args": None,
        "eval_args": {"split": {"LS": "valid_and_test"}, "order": "TO", "group_by": "user",
                      "mode": "full"},
        "metrics": ["Hit", "NDCG", "MRR"], "topk": [10], "valid_metric": "NDCG@10",
        "epochs": a.epochs, "device": a.device, "use_gpu": a.device != "cpu",
        "show_progress": False,
        "seed": 0, "reproducibility": True, "log_wandb": False})
    init_seed(config["seed"], config["reproducibility"])
    dataset = create_dataset(config)
    train, valid, test = data_preparation(config, dataset)
    model = SASRec(config, train._dataset).to(config["device"])
    trainer = Trainer(config, model)
    if a.estimate:
        a.out.write_text(json.dumps(estimate(trainer, model, train, a.estimate), indent=1))
        print(a.out.read_text())
        return
    # wall time of every epoch (training and its validation) and when the best was reached
    stamps: list[float] = []
    start = time.perf_counter()
    fit_epoch, valid_epoch = trainer._train_epoch, trainer._valid_epoch
    best = {"score": -1.0, "at": 0.0, "epoch": -1}

    limited = {"epochs": None}

    def timed_train(*args, **kw):  # type: ignore[no-untyped-def]
        out = fit_epoch(*args, **kw)
        if a.device != "cpu":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return out

    class TimeUp(Exception):
        pass

    def time_limit(epoch: int, score: float) -> None:  # after the epoch's validation
        if a.time_limit and time.perf_counter() - start > a.time_limit:
            limited["epochs"] = len(stamps)
            raise TimeUp

    def timed_valid(*args, **kw):  # type: ignore[no-untyped-def]
        score, result = valid_epoch(*args, **kw)
        if score > best["score"]:
            best.update(score=float(score), at=time.perf_counter() - start,
                        epoch=len(stamps) - 1)
        return score, result

    trainer._train_epoch, trainer._valid_epoch = timed_train, timed_valid
    try:  # (RecBole saved the best model before it called back)
        trainer.fit(train, valid, saved=True, show_progress=False, callback_fn=time_limit)
    except TimeUp:
        pass
    train_seconds = time.perf_counter() - start
    recbole_test = trainer.evaluate(test, load_best_model=True, show_progress=False)

    # ranks of the test item, computed as Sampan computes them (ties pessimistic)
    model.eval()
    ranks: dict[str, float] = {}
    with torch.no_grad():
        for interaction, history_index, positive_u, positive_i in test:
            scores = model.full_sort_predict(interaction.to(config["device"])).view(
                len(interaction), -1)
            scores[:, 0] = -float("inf")  # padding
            if history_index is not None:
                scores[history_index] = -float("inf")
            own = scores[positive_u, positive_i]
            rank = (scores >= own.unsqueeze(1)).sum(dim=1)
            users = dataset.id2token("user_id", interaction["user_id"].cpu().numpy())
            ranks.update({str(u): float(r) for u, r in zip(users, rank.tolist(),
                                                           strict=True)})
    epochs = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)]
    device_name = torch.cuda.get_device_name() if a.device != "cpu" else cpu_name()
    a.out.write_text(json.dumps({
        "ranks": ranks, "epoch_seconds": epochs, "epochs": len(stamps),
        "seconds_to_best": best["at"], "best_epoch": best["epoch"],
        "train_seconds": train_seconds, "threads": torch.get_num_threads(),
        "device": a.device, "device_name": device_name,
        "time_limited_after_epochs": limited["epochs"],
        "inputs": {"events_sha256": hashlib.sha256(events.read_bytes()).hexdigest(),
                   "max_len": a.max_len, "epochs": a.epochs, "time_limit": a.time_limit},
        "made": f"{dt.date.today().isoformat()} on {device_name}",
        "recbole_test": {k: float(v) for k, v in recbole_test.items()},
        "items": int(dataset.item_num - 1), "users": len(ranks)}, indent=1))
    shutil.rmtree(work / "saved", ignore_errors=True)


def cpu_name() -> str:
    """The CPU's model name, with its family and model (a virtual machine's name may not
    say which generation it is)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    except OSError:
        return "cpu"
    name = info.get("model name", "cpu")
    return f"{name} family {info.get('cpu family', '?')} model {info.get('model', '?')}"


def estimate(trainer, model, train, n: int) -> dict:  # type: ignore[no-untyped-def]
    """Seconds a training batch (the mean of ``n`` after 2 untimed) and an epoch's worth."""
    import torch

    stamps: list[float] = []
    loss = model.calculate_loss

    class Enough(Exception):
        pass

    def timed(interaction):  # type: ignore[no-untyped-def]
        stamps.append(time.perf_counter())
        if len(stamps) > n + 2:
            raise Enough
        return loss(interaction)

    model.calculate_loss = timed
    try:
        trainer._train_epoch(train, 0, show_progress=False)
    except Enough:
        pass
    if len(stamps) > n + 2:  # the n batches after the 2 untimed
        timed_batches, per = n, (stamps[-1] - stamps[2]) / n
    else:  # an epoch shorter than n + 2 batches: all of it
        timed_batches = len(stamps)
        per = (time.perf_counter() - stamps[0]) / max(len(stamps), 1) if stamps else 0.0
    return {"seconds_per_batch": per, "batches_per_epoch": len(train),
            "epoch_seconds": per * len(train), "train_sequences": len(train.dataset),
            "timed_batches": timed_batches, "threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
