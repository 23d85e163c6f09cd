"""A ClientApp that wraps the project's honest one and corrupts its replies, by partition id:
0 → update scaled to norm 10⁶, 1 → a NaN in the update, 2 → an update of the wrong shape; others honest."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fed_dp.clients.app import query as honest_query
from fed_dp.clients.app import train as honest_train

FAULTS = {0: "huge", 1: "nan", 2: "shape"}
app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return honest_query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = honest_train(msg, context)
    arrays = reply.content["update"].to_numpy_ndarrays()
    fault = FAULTS.get(int(context.node_config["partition-id"]))
    if fault == "huge":
        arrays[0] = (np.ones_like(arrays[0]) * 1e6 / np.sqrt(arrays[0].size)).astype(np.float32)
    elif fault == "nan":
        arrays[0] = arrays[0].copy()
        arrays[0][0] = np.nan
    elif fault == "shape":
        arrays[0] = np.zeros(arrays[0].size + 3, dtype=np.float32)
    return Message(content=RecordDict({"update": ArrayRecord(arrays), "metrics": reply.content["metrics"]}),
                   reply_to=msg)
