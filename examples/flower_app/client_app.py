"""ClientApp: a node trains the users it hosts and replies with their clipped, summed updates."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from task import make_task

from fed_dp import LocalTraining, LocalTrainer, hosted_users, query_reply, train_reply

app = ClientApp()
trainer = LocalTrainer(make_task(), LocalTraining(epochs=2, batch_size=4, lr=0.05))


@app.query()
def query(msg: Message, context: Context) -> Message:  # which users this node hosts
    return query_reply(msg, hosted_users(context.node_config, trainer.task.num_users), model=trainer.model)


@app.train()
def train(msg: Message, context: Context) -> Message:  # train the sampled ones
    return train_reply(msg, trainer, hosted=hosted_users(context.node_config, trainer.task.num_users))
