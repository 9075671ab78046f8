"""benchmarks/replay_speculative.py's replay: a hand-made trace's steps, rows and draft counts (no model)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import replay_speculative as replay  # noqa: E402

from opencoti.engine.core import speculative  # noqa: E402

LINE = (6.2e-3, 1.1e-3)


def sevens(states: list) -> SimpleNamespace:
    """A drafter module's interface whose every draft is ``k`` sevens; its states go to ``states``."""
    def new_state(k_max: int) -> SevensDrafter.DraftState:
        states.append(SevensDrafter.DraftState(k_max))
        return states[-1]

    return SimpleNamespace(DraftState=new_state)


class SevensDrafter:
    """Every draft is ``k`` sevens; the plan verifies 3 at most."""

    class DraftState:
        def __init__(self, k_max: int):
            self.k_max, self.idle, self.drafted, self.accepted = k_max, 0, 0, 0
            self.asked: list[tuple[int, int]] = []  # (context length, k) of each proposal
            self.updates: list[tuple[int, int]] = []

        def propose(self, tokens, k, recent=None):
            self.asked.append((len(tokens), k))
            return [7] * k

        def update(self, proposed, accepted):
            self.updates.append((proposed, accepted))
            self.drafted += proposed
            self.accepted += accepted

    class StepCosts:
        def plan(self, jobs, rows, limits):
            return [min(limits[0], 3)]


def test_steps_rows_and_draft_counts_of_a_hand_made_trace():
    states: list = []
    mod = sevens(states)
    prompt = [100, 101, 102]
    answer = [1, 7, 5, 7, 7, 7, 7, 7, 7, 7, 7]  # the first token comes from the prefill
    res = replay.replay_request(mod, SevensDrafter.StepCosts(), None, prompt, answer, max_tokens=11, k_max=8,
                                budget=16)
    st = states[0]
    # step 1: 8 sevens proposed (10 tokens left, one after the draft), 3 verified, 7 accepted then 5: emits 7, 5
    # step 2: k = 11 - 3 - 1 = 7, 3 verified and accepted: emits 7, 7, 7, 7
    # step 3: k = 11 - 7 - 1 = 3, 3 verified and accepted: emits the last 4
    assert st.asked == [(4, 8), (6, 7), (10, 3)]
    assert st.updates == [(3, 1), (3, 3), (3, 3)]
    assert res == {"tokens": 10, "steps": 3, "rows": 12, "draft_n": 9, "draft_n_accepted": 7}
    assert replay.estimated_ratio(10, 3, 12, LINE) == pytest.approx(10 * 7.3 / (3 * 6.2 + 12 * 1.1))
    assert replay.estimated_ratio(10, 10, 10, LINE) == pytest.approx(1.0)  # no drafts: off's speed


def test_the_budget_bounds_the_verified_rows_and_the_answer_its_acceptance():
    states: list = []
    mod = sevens(states)
    res = replay.replay_request(mod, SevensDrafter.StepCosts(), None, [100], [1, 7, 7], max_tokens=160, k_max=8,
                                budget=2)
    # two sevens asked for (the step's row budget), both accepted, and the answer (ended by EOS) has
    # nothing after them
    assert states[0].asked == [(2, 2)] and states[0].updates == [(2, 2)]
    assert res == {"tokens": 2, "steps": 1, "rows": 3, "draft_n": 2, "draft_n_accepted": 2}


def test_the_current_drafter_replays_with_its_own_bookkeeping():
    answer = list(range(1000, 1040))
    first = {"prompt": [5, 6, 7], "answer": answer, "max_tokens": 160}
    # repeats the first's answer, then two tokens of its own (a draft never reaches the answer's end)
    second = {"prompt": [8, 9, 10], "answer": answer + [2000, 2001], "max_tokens": 160}
    res = replay.replay_round(speculative, [first, second], LINE, k_max=8, budget=16)
    assert res[0]["draft_n"] == 0 and res[0]["steps"] == res[0]["rows"] == 39  # nothing to copy: off's steps
    later = res[1]
    assert later["tokens"] == 41 and later["draft_n"] > 0 and later["draft_n_accepted"] == later["draft_n"]
    assert later["rows"] == later["steps"] + later["draft_n"]
    assert later["steps"] == later["tokens"] - later["draft_n_accepted"]  # each step: its accepted drafts + one
    # the same request without the round's earlier answers has nothing to draft from
    alone = replay.replay_request(speculative, replay.fixed_costs(speculative, LINE), None, second["prompt"],
                                  second["answer"], 160, 8, 16)
    assert alone["draft_n"] == 0 and alone["steps"] == 41


def test_a_bad_cost_line_is_refused():
    assert replay.parse_line("6.2,1.1") == (6.2, 1.1)
    for bad in ("6.2", "a,b", "0,1.1", "6.2,-1"):
        with pytest.raises(SystemExit, match="--line"):
            replay.parse_line(bad)
