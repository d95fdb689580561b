"""A tier's step cost curve, measured at start (specdec/engine/cost_curve.py) and reported in its status: the
points it times (coarse grid first, within the budget, at least MIN_POINTS), the scratch slots given back, and
both tiers of a real cluster reporting it (StatusResponse.cost_curve, and the prefills of feed_cost), which the
coordinator prices from."""

from __future__ import annotations

import pytest

from specdec.engine import cost_curve
from specdec.engine.config import BatchConfig, TierConfig
from specdec.engine.engine import Engine
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from tests.helpers import device_model


@pytest.fixture(scope="module")
def engine(tiny_target):
    e = Engine(TierConfig(ModelConfig("tiny"), batch=BatchConfig(max_batch_tokens=64)), load_model(device_model(tiny_target)),
               TokenizerSource.of(load_tokenizer(tiny_target)))
    yield e


def test_points_span_the_grid_within_the_limits_and_give_the_slots_back(engine):
    free = engine.cache.free_slots
    points = cost_curve.measure(engine.runner, engine.cache, 16, 64, budget_s=60.0)
    wanted = [(b, b * t) for b, t in cost_curve.GRID if b <= 16 and b * t <= 64]
    assert [(b, n) for b, n, _ in points] == wanted  # the whole grid fits the budget here, in its order
    assert wanted[:2] == [(1, 1), (16, 16)]  # a decode step alone and in a full batch come first
    assert all(ms > 0 for _, _, ms in points)
    assert engine.cache.free_slots == free


def test_a_spent_budget_still_measures_the_minimum_and_zero_measures_nothing(engine):
    points = cost_curve.measure(engine.runner, engine.cache, 64, 512, budget_s=1e-9)
    assert [(b, n) for b, n, _ in points] == [(1, 1), (16, 16), (1, 4), (16, 64)][: cost_curve.MIN_POINTS]
    assert cost_curve.measure(engine.runner, engine.cache, 64, 512, budget_s=0.0) == []


def test_the_first_points_are_timed_again_last(engine, monkeypatch):
    """They run first, while tiers started beside this one may still be importing on the same cores."""
    calls = []
    forward = engine.runner.forward_checked
    monkeypatch.setattr(engine.runner, "forward_checked", lambda feeds: calls.append(len(feeds)) or forward(feeds))
    points = cost_curve.measure(engine.runner, engine.cache, 16, 64, budget_s=60.0)
    firsts = [b for b, _, _ in points[: cost_curve.MIN_POINTS]]
    per_point = [b for b, _, _ in points for _ in range(cost_curve.REPEATS)]
    assert calls == [16, *per_point, *[b for b in firsts for _ in range(cost_curve.REPEATS)]]  # context, grid, again


def test_prefills_are_timed_scoring_only_their_last_token(engine, monkeypatch):
    """measure_feed: one session fed each of FEEDS tokens (within max_tokens), one logit row, its slot given back."""
    feeds = []
    forward = engine.runner.forward_checked
    monkeypatch.setattr(engine.runner, "forward_checked", lambda f: feeds.extend(f) or forward(f))
    free = engine.cache.free_slots
    points = cost_curve.measure_feed(engine.runner, engine.cache, 64)
    assert [(b, n) for b, n, _ in points] == [(1, n) for n in cost_curve.FEEDS] and all(ms > 0 for *_, ms in points)
    assert [(len(f.tokens), f.num_logits, f.cached) for f in feeds] == [
        (n, 1, 0) for n in cost_curve.FEEDS for _ in range(cost_curve.REPEATS)]
    assert engine.cache.free_slots == free
    assert [n for _, n, _ in cost_curve.measure_feed(engine.runner, engine.cache, 32)] == [16]


def test_a_point_slower_than_a_larger_one_takes_its_time():
    """A step with more tokens is never faster: measured beside a starting tier, a one-token step timed at 85 ms
    where two tokens took 7.3."""
    timed = [(1, 1, 84.8), (16, 16, 134.4), (1, 4, 94.3), (16, 64, 99.0), (1, 2, 7.3), (16, 32, 56.2), (1, 8, 16.8),
             (4, 4, 11.2)]
    assert cost_curve.monotone(timed) == [(1, 1, 7.3), (16, 16, 56.2), (1, 4, 16.8), (16, 64, 99.0), (1, 2, 7.3),
                                          (16, 32, 56.2), (1, 8, 16.8), (4, 4, 11.2)]
    clean = [(1, 1, 6.1), (1, 2, 6.7), (1, 4, 10.3), (16, 16, 30.7), (16, 64, 97.6)]
    assert cost_curve.monotone(clean) == clean


def test_both_tiers_report_their_curve(self_draft_cluster):
    for tier in ("target", "draft"):
        curve = self_draft_cluster.status(tier).cost_curve
        assert len(curve) >= cost_curve.MIN_POINTS and curve[0].sessions == 1 and curve[0].tokens == 1
        assert all(p.ms > 0 for p in curve)
        feeds = self_draft_cluster.status(tier).feed_cost
        assert [(p.sessions, p.tokens) for p in feeds] == [(1, n) for n in cost_curve.FEEDS] and all(p.ms > 0 for p in feeds)
