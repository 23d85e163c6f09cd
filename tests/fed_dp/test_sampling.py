"""Tests of fed_dp.sampling: the user samplers and the accounting event each one implies.

Expected ε values are computed in the test with dp_accounting directly, from an event built by hand from
the table of docs/explanation/mechanism.md, Samplers and their accounting — never from ``fed_dp.sampling.dp_event``. Empirical sampler behaviour is
checked against closed-form binomial means with a 5-sigma bound (the seeds are fixed, so a run is
deterministic; the bound says how far from the law the fixed draw may lie).
"""

from __future__ import annotations

import hashlib
import io
import math

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp

from fed_dp.accounting import epsilon
from fed_dp.config import PrivacyConfig
from fed_dp.sampling import make_sampler, stable_group

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
DELTA = 1e-5
REL = 1e-9  # same event through the same library: agreement to rounding


# ------------------------------------------------------------------------------------------------
# Independent references
# ------------------------------------------------------------------------------------------------


def direct_epsilon(event: dp_accounting.DpEvent, accountant: str, relation=ADD_REMOVE, delta=DELTA) -> float:
    """ε of ``event`` from a fresh dp_accounting accountant, independent of fed_dp.accounting."""
    if accountant == "pld":
        acc = pld.PLDAccountant(neighboring_relation=relation)
    else:
        acc = rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event)
    return acc.get_epsilon(delta)


def ref_group(user_id, groups: int) -> int:
    """BLAKE2b-64 of str(user_id), big-endian, modulo ``groups`` (the documented stable hash)."""
    digest = hashlib.blake2b(str(user_id).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % groups


def binomial_ok(count: int, trials: int, p: float, z: float = 5.0) -> bool:
    """``count`` lies within z standard deviations of Binomial(trials, p)'s mean."""
    sd = math.sqrt(trials * p * (1 - p))
    return abs(count - trials * p) <= z * sd + 1e-9


# Hand-built events, per docs/explanation/mechanism.md, Samplers and their accounting (N, B, T, σ, b written out explicitly in each case).

SIGMA = 1.5


def poisson_case(accountant):
    cfg = PrivacyConfig(num_users=1000, expected_cohort=20, rounds=40, noise_multiplier=SIGMA, delta=DELTA,
                        accountant=accountant)

    def event(t):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(20 / 1000, dp_accounting.GaussianDpEvent(SIGMA)), t)

    return cfg, event, ADD_REMOVE


def without_replacement_case(accountant):
    cfg = PrivacyConfig(num_users=1000, expected_cohort=20, rounds=40, noise_multiplier=SIGMA, delta=DELTA,
                        sampler="without-replacement", accountant=accountant)

    def event(t):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(1000, 20, dp_accounting.GaussianDpEvent(SIGMA / 2)), t)

    return cfg, event, REPLACE_ONE


def all_case(accountant):
    cfg = PrivacyConfig(num_users=8, expected_cohort=8, rounds=40, noise_multiplier=4 * SIGMA, delta=DELTA,
                        sampler="all", accountant=accountant)

    def event(t):
        return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4 * SIGMA), t)

    return cfg, event, ADD_REMOVE


def cyclic_case(accountant):
    # T = 41 is not a multiple of b = 4: ⌈41/4⌉ = 11 participations, q_b = 20·4/1000.
    cfg = PrivacyConfig(num_users=1000, expected_cohort=20, rounds=41, noise_multiplier=SIGMA, delta=DELTA,
                        sampler="cyclic-poisson", noise="bandmf", bands=4, accountant=accountant)

    def event(t):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(20 * 4 / 1000, dp_accounting.GaussianDpEvent(SIGMA)),
            -(-t // 4))

    return cfg, event, ADD_REMOVE


def min_sep_case(accountant):
    # N // B = 1000 // 100 = 10 groups; T = 45 → k = ⌈45/10⌉ = 5.
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=45, noise_multiplier=3.0, delta=DELTA,
                        sampler="min-sep", noise="bandmf", bands=3, accountant=accountant)

    def event(t):
        return dp_accounting.GaussianDpEvent(3.0 / math.sqrt(-(-t // 10)))

    return cfg, event, ADD_REMOVE


CASES = {
    "poisson": (poisson_case, ("pld", "rdp")),
    "without-replacement": (without_replacement_case, ("rdp",)),
    "all": (all_case, ("pld", "rdp")),
    "cyclic-poisson": (cyclic_case, ("pld", "rdp")),
    "min-sep": (min_sep_case, ("pld", "rdp")),
}
CASE_PARAMS = [
    pytest.param(name, acc, id=f"{name}-{acc}") for name, (_, accs) in CASES.items() for acc in accs
]


# ------------------------------------------------------------------------------------------------
# Accounting: ε equals dp_accounting on the hand-built event of docs/explanation/mechanism.md, Samplers and their accounting
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, accountant", CASE_PARAMS)
def test_epsilon_matches_hand_built_event(name, accountant):
    cfg, event, relation = CASES[name][0](accountant)
    assert cfg.sampler == name
    expected = direct_epsilon(event(cfg.rounds), accountant, relation)
    assert epsilon(cfg) == pytest.approx(expected, rel=REL)
    assert epsilon(cfg, cfg.rounds) == pytest.approx(expected, rel=REL)


@pytest.mark.parametrize("name, accountant", CASE_PARAMS)
def test_epsilon_after_fewer_rounds_matches_hand_built_event(name, accountant):
    cfg, event, relation = CASES[name][0](accountant)
    # 7 rounds: 2 cyclic participations (⌈7/4⌉), 1 min-sep participation; 13: 4 and 2.
    got = []
    for t in (7, 13):
        expected = direct_epsilon(event(t), accountant, relation)
        got.append(epsilon(cfg, t))
        assert got[-1] == pytest.approx(expected, rel=REL), t
    assert got[0] <= got[1]


def test_pld_and_rdp_are_both_reported_and_pld_is_tighter():
    for make, _ in (CASES["poisson"], CASES["cyclic-poisson"]):
        eps_pld = epsilon(make("pld")[0])
        eps_rdp = epsilon(make("rdp")[0])
        assert 0 < eps_pld < eps_rdp


def test_min_sep_explicit_max_participations_is_used_and_under_count_refused():
    cfg = PrivacyConfig(num_users=1000, expected_cohort=100, rounds=45, noise_multiplier=3.0, delta=DELTA,
                        sampler="min-sep", max_participations=7, accountant="rdp")
    expected = direct_epsilon(dp_accounting.GaussianDpEvent(3.0 / math.sqrt(7)), "rdp")
    assert epsilon(cfg) == pytest.approx(expected, rel=REL)
    with pytest.raises(ValueError, match="max_participations"):
        cfg.replace(max_participations=4)  # ⌈45/10⌉ = 5 would be under-counted


def test_without_replacement_neighbouring_relation_matters():
    """The replace-one event is not the add/remove one: the σ/2 matters (guards against dropping it)."""
    cfg, event, _ = without_replacement_case("rdp")
    wrong = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(1000, 20, dp_accounting.GaussianDpEvent(SIGMA)), 40)
    assert epsilon(cfg) > 1.2 * direct_epsilon(wrong, "rdp", REPLACE_ONE)


# ------------------------------------------------------------------------------------------------
# Empirical behaviour of each sampler
# ------------------------------------------------------------------------------------------------


def _draw(cfg, seed, rounds=None):
    sampler = make_sampler(cfg, seed=seed)
    return [sampler.next_cohort() for _ in range(cfg.rounds if rounds is None else rounds)]


def _check_cohort_form(cohort, num_users):
    assert cohort.dtype == torch.int64 and cohort.ndim == 1
    values = cohort.tolist()
    assert values == sorted(set(values)), "cohort must be sorted distinct ids"
    assert all(0 <= v < num_users for v in values)


def test_poisson_inclusion_frequency_and_varying_cohort_size():
    N, B, T = 200, 20, 500
    q = B / N
    cfg = PrivacyConfig(num_users=N, expected_cohort=B, rounds=T, noise_multiplier=1.0, delta=DELTA)
    cohorts = _draw(cfg, seed=11)
    counts = torch.zeros(N, dtype=torch.int64)
    for c in cohorts:
        _check_cohort_form(c, N)
        counts[c] += 1
    # Every user is included in each round with probability q: per-user counts ~ Binomial(T, q).
    assert all(binomial_ok(int(n), T, q) for n in counts)
    assert binomial_ok(int(counts.sum()), N * T, q, z=5)
    # Cohort sizes ~ Binomial(N, q): they vary, with mean B and variance N q (1 − q) = 18.
    sizes = torch.tensor([len(c) for c in cohorts], dtype=torch.float64)
    assert len(set(sizes.tolist())) > 5
    assert abs(sizes.mean().item() - B) <= 5 * math.sqrt(N * q * (1 - q) / T)
    var = sizes.var().item()
    assert 0.7 * N * q * (1 - q) < var < 1.4 * N * q * (1 - q)


def test_poisson_different_seeds_give_different_cohorts():
    cfg = PrivacyConfig(num_users=200, expected_cohort=20, rounds=5, noise_multiplier=1.0, delta=DELTA)
    a, b, a2 = _draw(cfg, 1), _draw(cfg, 2), _draw(cfg, 1)
    assert any(not torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(a, a2))


def test_without_replacement_exactly_b_distinct_ids_uniformly():
    N, B, T = 100, 10, 600
    cfg = PrivacyConfig(num_users=N, expected_cohort=B, rounds=T, noise_multiplier=1.0, delta=DELTA,
                        sampler="without-replacement", accountant="rdp")
    counts = torch.zeros(N, dtype=torch.int64)
    for c in _draw(cfg, seed=3):
        _check_cohort_form(c, N)
        assert len(c) == B
        counts[c] += 1
    # Each round includes a given user with probability B/N, rounds independent.
    assert all(binomial_ok(int(n), T, B / N) for n in counts)


def test_all_sampler_takes_every_user_every_round():
    cfg = PrivacyConfig(num_users=7, expected_cohort=7, rounds=5, noise_multiplier=1.0, delta=DELTA, sampler="all")
    for c in _draw(cfg, seed=0):
        assert c.tolist() == list(range(7))


def test_all_sampler_requires_b_equal_n():
    with pytest.raises(ValueError, match="expected_cohort"):
        PrivacyConfig(num_users=7, expected_cohort=6, rounds=5, noise_multiplier=1.0, delta=DELTA, sampler="all")


def test_cyclic_poisson_users_only_in_their_group_rounds_at_rate_qb():
    N, B, b, T = 400, 10, 4, 400
    qb = B * b / N
    cfg = PrivacyConfig(num_users=N, expected_cohort=B, rounds=T, noise_multiplier=1.0, delta=DELTA,
                        sampler="cyclic-poisson", bands=b)
    groups = [ref_group(u, b) for u in range(N)]
    group_sizes = [groups.count(g) for g in range(b)]
    counts = torch.zeros(N, dtype=torch.int64)
    last_seen = {}
    for t, c in enumerate(_draw(cfg, seed=5)):
        _check_cohort_form(c, N)
        for u in c.tolist():
            assert groups[u] == t % b, f"user {u} (group {groups[u]}) sampled in round {t}"
            if u in last_seen:
                assert t - last_seen[u] >= b
            last_seen[u] = t
        counts[c] += 1
    rounds_per_group = T // b  # T is a multiple of b here
    for u in range(N):
        assert binomial_ok(int(counts[u]), rounds_per_group, qb), u
    for g in range(b):
        total = int(sum(counts[u] for u in range(N) if groups[u] == g))
        assert binomial_ok(total, group_sizes[g] * rounds_per_group, qb), g


def test_min_sep_separation_participation_count_and_partition():
    N, B, T = 53, 10, 23  # m = N // B = 5 groups of sizes 11, 11, 11, 10, 10; k = ⌈23/5⌉ = 5
    m = N // B
    k = math.ceil(T / m)
    cfg = PrivacyConfig(num_users=N, expected_cohort=B, rounds=T, noise_multiplier=1.0, delta=DELTA,
                        sampler="min-sep", noise="bandmf", bands=m)
    cohorts = _draw(cfg, seed=9)
    participations = {u: [] for u in range(N)}
    for t, c in enumerate(cohorts):
        _check_cohort_form(c, N)
        for u in c.tolist():
            participations[u].append(t)
    for u, rounds in participations.items():
        assert 1 <= len(rounds) <= k
        assert all(r2 - r1 >= m for r1, r2 in zip(rounds, rounds[1:])), (u, rounds)
    assert max(len(r) for r in participations.values()) == k
    first = [set(c.tolist()) for c in cohorts[:m]]
    assert set().union(*first) == set(range(N))
    assert sum(len(s) for s in first) == N  # disjoint: a partition
    assert sorted(len(s) for s in first) == [N // m] * (m - N % m) + [N // m + 1] * (N % m)
    assert cfg.participations() == k


def test_min_sep_split_depends_on_seed():
    cfg = PrivacyConfig(num_users=50, expected_cohort=10, rounds=5, noise_multiplier=1.0, delta=DELTA,
                        sampler="min-sep")
    assert [c.tolist() for c in _draw(cfg, 1)] != [c.tolist() for c in _draw(cfg, 2)]


# ------------------------------------------------------------------------------------------------
# stable_group
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("user_id", [0, 1, 7, 12345, 2**40, "alice", "user-17", "17"])
@pytest.mark.parametrize("groups", [1, 2, 3, 7, 16])
def test_stable_group_is_the_documented_hash(user_id, groups):
    assert stable_group(user_id, groups) == ref_group(user_id, groups)


def test_stable_group_spreads_users():
    counts = [0] * 4
    for u in range(4000):
        counts[stable_group(u, 4)] += 1
    assert all(binomial_ok(c, 4000, 0.25) for c in counts)


# ------------------------------------------------------------------------------------------------
# Checkpointing, limits, seeds
# ------------------------------------------------------------------------------------------------


ALL_CONFIGS = [
    PrivacyConfig(num_users=60, expected_cohort=6, rounds=12, noise_multiplier=1.0, delta=DELTA),
    PrivacyConfig(num_users=60, expected_cohort=6, rounds=12, noise_multiplier=1.0, delta=DELTA,
                  sampler="without-replacement", accountant="rdp"),
    PrivacyConfig(num_users=6, expected_cohort=6, rounds=12, noise_multiplier=1.0, delta=DELTA, sampler="all"),
    PrivacyConfig(num_users=60, expected_cohort=6, rounds=12, noise_multiplier=1.0, delta=DELTA,
                  sampler="cyclic-poisson", noise="bandmf", bands=3),
    PrivacyConfig(num_users=60, expected_cohort=6, rounds=12, noise_multiplier=1.0, delta=DELTA,
                  sampler="min-sep", noise="bandmf", bands=3),
]


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: c.sampler)
def test_state_dict_round_trip_continues_identically(cfg):
    original = make_sampler(cfg, seed=1234)
    for _ in range(5):
        original.next_cohort()
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # as a checkpoint would
    buffer.seek(0)
    state = torch.load(buffer)
    expected = [original.next_cohort() for _ in range(cfg.rounds - 5)]

    restored = make_sampler(cfg, seed=999)  # a resumed run starts with another seed, then adopts the checkpoint's
    restored.load_state_dict(state)
    assert restored.seed == 1234
    assert restored.rounds_sampled == 5
    got = [restored.next_cohort() for _ in range(cfg.rounds - 5)]
    assert all(torch.equal(x, y) for x, y in zip(expected, got))
    with pytest.raises(ValueError, match="rounds"):
        restored.next_cohort()  # the restored counter still knows where T is


def test_state_dict_is_not_aliased_to_the_live_generator():
    cfg = ALL_CONFIGS[0]
    sampler = make_sampler(cfg, seed=3)
    state = sampler.state_dict()
    after_state = [sampler.next_cohort() for _ in range(3)]
    sampler2 = make_sampler(cfg, seed=3)
    sampler2.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(after_state, [sampler2.next_cohort() for _ in range(3)]))


def test_load_state_refuses_another_sampler():
    poisson_cfg, wor_cfg = ALL_CONFIGS[0], ALL_CONFIGS[1]
    state = make_sampler(poisson_cfg, seed=1).state_dict()
    with pytest.raises(ValueError, match="poisson"):
        make_sampler(wor_cfg, seed=1).load_state_dict(state)


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: c.sampler)
def test_sampling_past_configured_rounds_raises(cfg):
    sampler = make_sampler(cfg, seed=0)
    for _ in range(cfg.rounds):
        sampler.next_cohort()
    with pytest.raises(ValueError, match="rounds"):
        sampler.next_cohort()


def test_seeds_from_entropy_unless_explicit():
    cfg = ALL_CONFIGS[0]
    a, b = make_sampler(cfg), make_sampler(cfg)
    assert a.seed != b.seed
    assert a.seeded_explicitly is False and b.seeded_explicitly is False
    assert a.state_dict()["seeded_explicitly"] is False
    c = make_sampler(cfg, seed=42)
    assert c.seed == 42 and c.seeded_explicitly is True
    assert c.state_dict()["seeded_explicitly"] is True
    # An explicit seed reproduces; entropy seeds (almost surely) do not.
    assert torch.equal(make_sampler(cfg, seed=42).next_cohort(), c.next_cohort())


def test_sampler_class_refuses_a_config_for_another_sampler():
    from fed_dp.sampling import PoissonSampler

    with pytest.raises(ValueError, match="poisson"):
        PoissonSampler(ALL_CONFIGS[1], seed=0)


def test_sampler_class_is_found_by_name_and_still_accepts_a_config():
    from fed_dp.sampling import SAMPLERS, sampler_class

    for name, cls in SAMPLERS.items():
        assert sampler_class(name) is cls
    with pytest.raises(ValueError, match="unknown sampler 'poison'"):
        sampler_class("poison")
    with pytest.warns(DeprecationWarning, match="sampler_class"):
        assert sampler_class(ALL_CONFIGS[0]) is SAMPLERS[ALL_CONFIGS[0].sampler]
