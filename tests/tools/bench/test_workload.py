"""The agent workload is a pure function of its spec (and the tokenizer): the same texts and
arrivals every time, the texts independent of the arrival rate, lengths within their bounds."""

import math
from dataclasses import replace

import pytest

from sgl_vtoken_tools.bench.tokenizer import approx_fit
from sgl_vtoken_tools.bench.workload import WorkloadSpec, build_workload


class WordFitter:
    """A server tokenizer stand-in: one token per space-separated word."""

    exact = True

    def tokenize(self, text):
        return text.split(" ")

    def fit(self, texts, targets, keep):
        return [
            " ".join(t.split(" ")[: max(n, len(k.split(" ")) if k else 0)])
            for t, n, k in zip(texts, targets, keep)
        ]


SPEC = WorkloadSpec(
    sessions=5,
    turns=4,
    rate=2.0,
    seed=7,
    system_tokens=64,
    user_tokens=20,
    tool_tokens=50,
    tool_min=10,
    tool_max=80,
)


def texts(work):
    return [work.system] + [t for s in work.sessions for t in (s.user, *s.tools)]


def test_same_spec_same_workload():
    a, b = build_workload(SPEC, WordFitter()), build_workload(SPEC, WordFitter())
    assert texts(a) == texts(b)
    assert [s.start for s in a.sessions] == [s.start for s in b.sessions]
    assert texts(build_workload(replace(SPEC, seed=8), WordFitter())) != texts(a)


def test_texts_do_not_depend_on_the_rate_and_fewer_sessions_play_a_prefix():
    a = build_workload(SPEC, WordFitter())
    burst = build_workload(replace(SPEC, rate=math.inf), WordFitter())
    assert texts(burst) == texts(a)
    assert all(s.start == 0.0 for s in burst.sessions)
    starts = [s.start for s in a.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    two = build_workload(replace(SPEC, sessions=2), WordFitter())
    assert texts(two) == texts(a)[: 1 + 2 * SPEC.turns]


def test_lengths_within_bounds():
    work = build_workload(SPEC, WordFitter())
    assert work.system_tokens == len(work.system.split(" ")) >= SPEC.system_tokens
    assert "read_file" in work.system  # the tool schema is kept whole
    for s in work.sessions:
        assert len(s.tools) == SPEC.turns - 1
        assert 4 <= len(s.user.split(" ")) <= 4 * SPEC.user_tokens
        assert all(SPEC.tool_min <= len(t.split(" ")) <= SPEC.tool_max for t in s.tools)


def test_approximate_fit_without_a_tokenizer():
    assert approx_fit(["a b c d e f g h i j"], [4], [""]) == ["a b c"]  # 4 tokens ~ 3 words
    assert approx_fit(["a b c d e f g h i j"], [1], ["a b c d e"]) == [
        "a b c d e"
    ]  # never below keep


@pytest.mark.parametrize(
    "field,value", [("sessions", 0), ("turns", 0), ("tool_min", 0), ("rate", 0.0)]
)
def test_bad_spec_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**{field: value})
    with pytest.raises(ValueError, match="tool_max"):
        WorkloadSpec(tool_min=50, tool_max=10)
