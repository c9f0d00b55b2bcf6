"""Tests for fmoe_jax.research.workloads on the shared data files and on small malformed files."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
from fmoe_jax.research import workloads
from fmoe_jax.research.workloads import ArrivalTrace, Prompt

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data directory {DATA} is absent")

MT_BENCH = DATA / "prompts" / "mt_bench_questions.jsonl"
SHAREGPT = DATA / "prompts" / "sharegpt_500.json"
ALPACA = DATA / "prompts" / "alpaca_eval_mixtral_outputs.json"
AZURE_CODE = DATA / "arrivals" / "azure_llm_2023_code.csv"
CORPORA = DATA / "corpora"


@pytest.fixture(scope="module")
def mt_bench() -> list[Prompt]:
    return workloads.load_mt_bench(MT_BENCH)


@pytest.fixture(scope="module")
def alpaca() -> list[Prompt]:
    return workloads.load_alpaca_eval(ALPACA)


# --- prompt sets ------------------------------------------------------------------------------------------


def test_mt_bench_has_80_questions_in_8_categories_of_10(mt_bench):
    assert len(mt_bench) == 80
    assert collections.Counter(p.category for p in mt_bench) == {
        c: 10
        for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }
    assert mt_bench[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert len({p.uid for p in mt_bench}) == 80


def test_sharegpt_skips_empty_prompts():
    prompts = workloads.load_sharegpt(SHAREGPT)
    assert len(prompts) == 500
    assert prompts[0].text == "How to stop automatic updates from the WSUS Server to a target machine"
    larger = workloads.load_sharegpt(DATA / "prompts" / "sharegpt_2978.json")
    assert len(larger) == 2977  # one of the 2,978 has an empty first turn
    assert all(p.text.strip() for p in larger)
    assert len({p.uid for p in larger}) == len(larger)


def test_alpaca_eval_categories_are_source_datasets(alpaca):
    assert len(alpaca) == 805
    assert collections.Counter(p.category for p in alpaca) == {
        "selfinstruct": 252,
        "oasst": 188,
        "koala": 156,
        "helpful_base": 129,
        "vicuna": 80,
    }


# --- store/eval split -------------------------------------------------------------------------------------


def test_split_is_disjoint_covering_and_seven_to_three(alpaca):
    store, evaluation = workloads.split_store_eval(alpaca, store_fraction=0.7, seed=0)
    store_uids, eval_uids = {p.uid for p in store}, {p.uid for p in evaluation}
    assert not store_uids & eval_uids
    assert store_uids | eval_uids == {p.uid for p in alpaca}
    assert len(store) == round(0.7 * len(alpaca))
    total = collections.Counter(p.category for p in alpaca)
    in_store = collections.Counter(p.category for p in store)
    for category, n in total.items():
        assert abs(in_store[category] - 0.7 * n) <= 1, category


def test_split_is_stratified_exactly_on_mt_bench(mt_bench):
    store, evaluation = workloads.split_store_eval(mt_bench)
    assert collections.Counter(p.category for p in store) == {c: 7 for c in {p.category for p in mt_bench}}
    assert collections.Counter(p.category for p in evaluation) == {
        c: 3 for c in {p.category for p in mt_bench}
    }


def test_split_is_deterministic_and_independent_of_input_order(mt_bench):
    store, _ = workloads.split_store_eval(mt_bench, seed=3)
    again, _ = workloads.split_store_eval(list(reversed(mt_bench)), seed=3)
    assert {p.uid for p in store} == {p.uid for p in again}
    other_seed, _ = workloads.split_store_eval(mt_bench, seed=4)
    assert {p.uid for p in store} != {p.uid for p in other_seed}


def test_split_is_pinned_across_runs(mt_bench):
    # sha256 of the uid, not hash(): the same eval set on every machine and Python version.
    _, evaluation = workloads.split_store_eval(mt_bench, seed=0)
    expected = [81, 85, 86, 95, 96, 100, 102, 104, 105, 113, 119, 120]
    expected += [123, 126, 129, 131, 133, 139, 144, 148, 149, 151, 152, 157]
    assert [p.uid for p in evaluation] == [f"mt_bench/{i}" for i in expected]


def test_split_rejects_repeated_uids():
    prompts = [Prompt("a", "s", "c", "same"), Prompt("b", "s", "c", "same")]
    with pytest.raises(ValueError, match="repeated: \\['same'\\]"):
        workloads.split_store_eval(prompts)


# --- arrival traces ---------------------------------------------------------------------------------------


def test_azure_arrivals_are_monotone_from_zero():
    trace = workloads.load_azure_arrivals(AZURE_CODE)
    assert len(trace) == 8819
    assert trace.arrival_s.dtype == np.float64
    assert trace.arrival_s[0] == 0.0
    assert np.all(np.diff(trace.arrival_s) >= 0)
    # First two rows: 18:17:03.9799600 and 18:17:04.0319600; the last is 19:14:19.9280160.
    np.testing.assert_allclose(trace.arrival_s[1], 0.052, rtol=0, atol=1e-9)
    np.testing.assert_allclose(trace.arrival_s[-1], 3435.948056, rtol=0, atol=1e-6)
    assert (trace.context_tokens[0], trace.generated_tokens[0]) == (4808, 10)


def test_azure_time_scale_and_limit():
    base = workloads.load_azure_arrivals(AZURE_CODE, limit=100)
    fast = workloads.load_azure_arrivals(AZURE_CODE, time_scale=0.5, limit=100)
    assert len(base) == len(fast) == 100
    np.testing.assert_allclose(np.diff(fast.arrival_s), 0.5 * np.diff(base.arrival_s), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(fast.generated_tokens, base.generated_tokens)


def test_assign_is_deterministic_cycles_prompts_and_clips(mt_bench):
    trace = workloads.load_azure_arrivals(AZURE_CODE, limit=200)
    pairs = trace.assign(mt_bench, seed=1, max_generated_tokens=32)
    assert pairs == trace.assign(mt_bench, seed=1, max_generated_tokens=32)
    assert pairs != trace.assign(mt_bench, seed=2, max_generated_tokens=32)
    assert [t for t, _, _ in pairs] == trace.arrival_s.tolist()
    assert {p.uid for _, p, _ in pairs[:80]} == {p.uid for p in mt_bench}  # every prompt once per pass
    generated = np.array([g for _, _, g in pairs])
    np.testing.assert_array_equal(generated, np.clip(trace.generated_tokens, 1, 32))
    assert generated.max() == 32


def test_arrival_trace_rejects_decreasing_times():
    with pytest.raises(ValueError, match="non-decreasing"):
        ArrivalTrace(np.array([0.0, 2.0, 1.0]), np.ones(3, np.int64), np.ones(3, np.int64))


# --- corpora ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora() -> dict[str, dict[str, str]]:
    return {part: workloads.load_corpora(CORPORA, part) for part in ("train", "held_out")}


def test_corpora_split_fractions(corpora):
    assert set(corpora["train"]) == {"arxiv", "books", "web", "code", "wikipedia_de", "shakespeare"}
    for domain, held_out in corpora["held_out"].items():
        train = corpora["train"][domain]
        assert train.endswith("\n")
        assert 0.05 <= len(held_out) / (len(train) + len(held_out)) < 0.06, domain


def test_split_corpus_keeps_all_text_of_unrepeated_file():
    text = (CORPORA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    train, held_out = workloads.split_corpus(text)
    assert train + held_out == text


def test_split_corpus_drops_the_repeated_tail_of_olmoe_files():
    # Each OLMoE file is its documents followed by a copy of their first half; the copy must not leak.
    text = (CORPORA / "olmoe_books.txt").read_text(encoding="utf-8")
    train, held_out = workloads.split_corpus(text)
    assert len(train) + len(held_out) < 0.6 * len(text)
    assert text.startswith(train + held_out)


def test_held_out_lines_do_not_appear_in_train(corpora):
    for domain, held_out in corpora["held_out"].items():
        long_lines = [line for line in held_out.split("\n") if len(line) >= 80]
        leaked = [line[:60] for line in long_lines if line in corpora["train"][domain]]
        assert not leaked, (domain, leaked[:3])


def test_domain_prompts_come_from_held_out_text(corpora):
    prompts = workloads.domain_prompts(CORPORA, n_per_domain=10, seed=0)
    assert collections.Counter(p.category for p in prompts) == {d: 10 for d in workloads.CORPUS_DOMAINS}
    assert len({p.uid for p in prompts}) == len(prompts)
    for p in prompts:
        assert 200 <= len(p.text) <= 600, p.uid
        held_out = corpora["held_out"][p.category]
        start = held_out.index(p.text)
        assert start == 0 or held_out[start - 1] in "\n \t", p.uid
        assert p.text not in corpora["train"][p.category], p.uid
    assert prompts == workloads.domain_prompts(CORPORA, n_per_domain=10, seed=0)
    assert prompts != workloads.domain_prompts(CORPORA, n_per_domain=10, seed=1)


def test_domain_prompts_asks_for_fewer_when_held_out_is_too_small():
    with pytest.raises(ValueError, match="ask for fewer or shorter prompts"):
        workloads.domain_prompts(CORPORA, n_per_domain=10_000)


# --- errors -----------------------------------------------------------------------------------------------


def test_missing_files_name_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    for load in (workloads.load_mt_bench, workloads.load_sharegpt, workloads.load_alpaca_eval):
        with pytest.raises(FileNotFoundError, match="nope.jsonl"):
            load(missing)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        workloads.load_azure_arrivals(missing)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        workloads.load_corpora(tmp_path / "corpora")


def test_corpora_dir_missing_a_domain_file(tmp_path):
    (tmp_path / "olmoe_arxiv.txt").write_text("line\n" * 100)
    with pytest.raises(FileNotFoundError, match="olmoe_books.txt.*'books' corpus"):
        workloads.load_corpora(tmp_path)


def test_malformed_mt_bench_line_names_file_and_line(tmp_path):
    path = tmp_path / "q.jsonl"
    good = json.dumps({"question_id": 1, "category": "math", "turns": ["What is 1+1?"]})
    path.write_text(good + "\n" + json.dumps({"question_id": 2, "turns": ["no category"]}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl, line 2: field 'category'"):
        workloads.load_mt_bench(path)
    path.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match=r"q.jsonl, line 2: not valid JSON"):
        workloads.load_mt_bench(path)


def test_malformed_json_prompt_files(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="p.json: top level is dict"):
        workloads.load_sharegpt(path)
    path.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human"}]}]))
    with pytest.raises(ValueError, match=r"p.json, item 0, conversations\[0\]: field 'value'"):
        workloads.load_sharegpt(path)
    path.write_text(json.dumps([{"instruction": "Say hi.", "dataset": "a"}, {"instruction": "No dataset."}]))
    with pytest.raises(ValueError, match="p.json, item 1: field 'dataset'"):
        workloads.load_alpaca_eval(path)


def test_malformed_azure_csv(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n")
    with pytest.raises(ValueError, match=r"lacks columns \['GeneratedTokens'\]"):
        workloads.load_azure_arrivals(path)
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,5\nyesterday,10,5\n"
    )
    with pytest.raises(ValueError, match="trace.csv, line 3: malformed row"):
        workloads.load_azure_arrivals(path)
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,ten,5\n")
    with pytest.raises(ValueError, match="trace.csv, line 2: malformed row"):
        workloads.load_azure_arrivals(path)
