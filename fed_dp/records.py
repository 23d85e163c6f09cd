"""The keys of a round's record: one definition, from which the docs' table is generated and against which tests
check what a run writes.

A record is one dict per round (``fed_dp.round_loop.run_rounds``; ``TrainResult.records``, ``DPResult.records``,
``results.json``, ``rounds-NAME.jsonl``). Rounds are numbered t = 1 … T; a fresh run with evaluation starts with
the record of round 0, the initial model. Public keys hold only released (noised) or public values and go to
every published file. Secret keys are computed from users' data outside the accounted mechanism (issue 25): the
server writes them to the operator's ``secret/diagnostics.jsonl`` without the prefix, and a simulation keeps them
in its in-memory records (and ``rounds-NAME.jsonl``) with the prefix ``nonprivate_``; ``results.json`` and the
public checkpoint never hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

PUBLIC, SECRET = "public", "secret"
#: The prefix of secret keys in a simulation's records (``fed_dp.round_loop.NONPRIVATE``).
SECRET_PREFIX = "nonprivate_"


@dataclass(frozen=True)
class RecordKey:
    """One key: ``name`` (a ``*`` stands for any suffix), what it means, ``part`` (public or secret) and
    ``when`` it is present (``"always"``: in every record of a released round)."""

    name: str
    meaning: str
    part: str
    when: str = "always"

    def __post_init__(self) -> None:
        if self.part not in (PUBLIC, SECRET):
            raise ValueError(f"part must be {PUBLIC!r} or {SECRET!r}, got {self.part!r}")

    @property
    def record_name(self) -> str:
        """The key as a simulation's record holds it (secret keys prefixed ``nonprivate_``)."""
        return self.name if self.part == PUBLIC else SECRET_PREFIX + self.name

    def matches(self, key: str) -> bool:
        name = self.record_name
        return key.startswith(name[:-1]) if name.endswith("*") else key == name


RECORD_KEYS: tuple[RecordKey, ...] = (
    RecordKey("round", "t: the t-th release, 1 … T; 0 is the initial model's evaluation, before any release", PUBLIC),
    RecordKey("epsilon", "user-level ε spent after round t at δ (0 at round 0); \"not private\" for the noiseless "
              "baselines and runs with noise_multiplier = 0", PUBLIC),
    RecordKey("delta", "δ of the accounting", PUBLIC),
    RecordKey("update_norm", "‖θ_t − θ_{t−1}‖ of the server step (post-processing of the noised release)", PUBLIC,
              "every released round"),
    RecordKey("non_private", "true: this run adds no noise (noise_multiplier = 0), it has no privacy", PUBLIC,
              "every record of a run with noise_multiplier = 0"),
    RecordKey("noised_average_norm", "‖(Σ_t + w_t)/B‖, the norm of the released noised average update (read by "
              "the clip-norm hint, fed_dp.clip_hint)", PUBLIC,
              "fixed clip norm, independent noise, no scale-then-privatize or moment estimation; σ > 0"),
    RecordKey("processes", "processes that trained the round's users (torchrun)", PUBLIC,
              "in-process runs under torchrun with several processes"),
    RecordKey("clip_norm", "ζ_t, the clip norm broadcast in round t", PUBLIC, "adaptive clipping"),
    RecordKey("next_clip_norm", "ζ_{t+1}, from the noised clip-bit sum (Andrew et al. 2021)", PUBLIC,
              "adaptive clipping"),
    RecordKey("nu_hat_*", "min, q25, median, q75, max of the second-moment estimate ν̂_t", PUBLIC,
              "adaptive optimizers (Adam, AdaGrad families)"),
    RecordKey("nu_hat_minus_phi_*", "the same quantiles of ν̂_t − Φ̂_t (bias-corrected optimizers)", PUBLIC,
              "optimizers with bias correction"),
    RecordKey("fraction_nu_hat_below_phi", "fraction of coordinates with ν̂_t − Φ̂_t < 0", PUBLIC,
              "optimizers with bias correction"),
    RecordKey("eval_*", "the task's evaluation on the server's held-out data (built-in tasks: eval_loss, "
              "eval_accuracy; an own task: the names its evaluate returns)", PUBLIC,
              "round 0, rounds t with t % eval_every == 0, and the last round"),
    RecordKey("group*", "built-in frequency-group tasks: loss and accuracy per class-frequency group", PUBLIC,
              "evaluated rounds of tasks with class groups"),
    RecordKey("cohort_size", "|S_t|, the users sampled", SECRET, "every released round"),
    RecordKey("replied_users", "users counted in Σ_t", SECRET, "every released round"),
    RecordKey("reclipped_replies", "node sums the server had to re-clip", SECRET, "every released round"),
    RecordKey("unclipped_users", "users whose update was not clipped (the exact clip-bit sum)", SECRET,
              "every released round"),
    RecordKey("round_seconds", "the round's duration (grows with the cohort)", SECRET, "every released round"),
    RecordKey("alignment_ratio", "‖Σ_t‖ / (|S_t|·ζ_t), from the un-noised sum", SECRET, "simulations"),
    RecordKey("train_loss", "mean local training loss of the round's users", SECRET, "simulations"),
    RecordKey("mean_update_norm", "mean norm of the users' updates before clipping", SECRET, "simulations"),
    RecordKey("fraction_clipped", "fraction of the round's users whose update was clipped", SECRET, "simulations"),
    RecordKey("vectorized", "1 when the users that needed a model each were vectorized", SECRET, "simulations"),
    RecordKey("one_step", "1 when some users trained on the one-step path", SECRET, "simulations"),
    RecordKey("dropped", "per node: why its sampled users were dropped, with counts", SECRET, "Flower runs"),
    RecordKey("failures", "per node: why it failed, without counts", SECRET, "Flower runs"),
    RecordKey("dropped_users", "sampled users dropped (no reply, late, malformed)", SECRET, "Flower runs"),
)


def documented(key: str) -> RecordKey | None:
    """The definition of ``key`` as a record holds it, or None when it is not documented."""
    return next((entry for entry in RECORD_KEYS if entry.matches(key)), None)


def markdown_table() -> str:
    """The reference table of record keys (Markdown), for the docs."""
    lines = ["| key | meaning | part | present |", "|---|---|---|---|"]
    for entry in RECORD_KEYS:
        key = f"`{entry.name}`" if entry.part == PUBLIC else f"`{entry.name}` (`{entry.record_name}` in a simulation)"
        meaning = entry.meaning.replace("|", "\\|")  # |S_t| inside a table cell
        lines.append(f"| {key} | {meaning} | {entry.part} | {entry.when} |")
    return "\n".join(lines)
