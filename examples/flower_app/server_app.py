"""ServerApp: fed-dp's user-level DP strategy in an ordinary Flower ServerApp."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from task import make_task

from fed_dp import PrivacyConfig, UserLevelDP, centralized_evaluation, make_optimizer, model_arrays

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    task = make_task()
    privacy = PrivacyConfig(num_users=task.num_users, expected_cohort=int(config["cohort"]), rounds=int(config["rounds"]),
                            target_epsilon=float(config["target-epsilon"]), delta=1e-4, accountant="rdp")
    strategy = UserLevelDP(privacy, make_optimizer("dp-adambc", lr=float(config["server-lr"])),
                           checkpoint_dir=str(config["checkpoint-dir"]) or None)
    result = strategy.start(grid=grid, initial_arrays=model_arrays(task.model()), evaluate_fn=centralized_evaluation(task))
    print(f"user-level epsilon {result.epsilon:.3f} at delta {result.delta:g}; held-out MSE "
          f"{result.records[-1]['eval_loss']:.3f}")
