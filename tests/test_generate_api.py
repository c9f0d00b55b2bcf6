"""`generate`'s Hugging Face arguments, prompt forms, chat templates, stop rules, log-probabilities and
streaming, on the shipped trained models."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fmoe_jax.research.tokenizer import CHAT_TEMPLATE

import fmoe_jax as fj
from fmoe_jax.prompts import encode_prompts
from fmoe_jax.sampling import from_hf_arguments, sampler_key

PROMPTS = ["Once upon a time", "def fibonacci(n):\n    "]
# One length and one sampling setting throughout, so that the tests share their compiled programs.
N = 12
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.95)
PENALTY = 1.8
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Who is the king?"}]


@pytest.fixture(scope="module")
def mixtral():
    """float32, so that generation and `forward` agree to float32 rounding (bfloat16 does not)."""
    return fj.load_model("fmoe-tiny-mixtral", dtype="float32")


# -- Hugging Face sampling names -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(), None),
        (dict(do_sample=False), fj.Greedy()),
        (dict(temperature=0), fj.Greedy()),
        (dict(temperature=0.0, do_sample=False, repetition_penalty=1.3), fj.Greedy(repetition_penalty=1.3)),
        (dict(do_sample=True), fj.Sample()),
        (dict(temperature=0.7), fj.Sample(temperature=0.7)),
        (dict(top_p=0.9), fj.Sample(top_p=0.9)),
        (
            dict(do_sample=True, temperature=0.5, top_k=7, top_p=0.8, repetition_penalty=1.2),
            fj.Sample(0.5, top_k=7, top_p=0.8, repetition_penalty=1.2),
        ),
    ],
)
def test_hf_names_map_onto_sampling_objects(kwargs, expected):
    assert from_hf_arguments(None, **kwargs) == (expected or fj.Greedy())


@pytest.mark.parametrize(
    "sampling, kwargs, match",
    [
        (fj.Sample(), dict(temperature=0.7), "either sampling=.* or the Hugging Face arguments"),
        (fj.Greedy(), dict(do_sample=False), "not both"),
        (None, dict(do_sample=True, temperature=0), "temperature must be a finite number > 0 with do_sample"),
        (None, dict(do_sample=True, temperature=-1.0), "got -1.0"),
        (None, dict(temperature=float("nan")), "got nan"),
        (None, dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
        (None, dict(top_p=1.5), "got 1.5"),
        (None, dict(do_sample=True, top_p=float("nan")), "got nan"),
        (None, dict(top_k=-2), "top_k must be an int >= 0"),
        (None, dict(top_k=2.5), "got 2.5"),
        (None, dict(do_sample=False, temperature=0.7), "do_sample=False decodes greedily and would ignore"),
        (None, dict(do_sample=False, top_k=5), "would ignore top_k=5"),
        (None, dict(temperature=0, top_p=0.9), "temperature=0 means greedy decoding"),
        (None, dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (None, dict(repetition_penalty=float("inf")), "got inf"),
        (None, dict(do_sample="yes"), "do_sample must be True or False"),
        ("greedy", dict(), "sampling must be fmoe_jax.Greedy"),
    ],
)
def test_conflicting_or_bad_sampling_arguments(sampling, kwargs, match):
    with pytest.raises(ValueError, match=match):
        from_hf_arguments(sampling, **kwargs)


def test_hf_names_generate_what_the_sampling_objects_generate(mixtral):
    by_name = fj.generate(mixtral, PROMPTS, N, seed=3, **SAMPLED)
    by_object = fj.generate(mixtral, PROMPTS, N, fj.Sample(**SAMPLED), seed=3)
    assert by_name.tokens == by_object.tokens
    assert by_name.tokens != fj.generate(mixtral, PROMPTS, N, seed=4, **SAMPLED).tokens  # the seed matters
    greedy = fj.generate(mixtral, PROMPTS, N, fj.Greedy())
    assert fj.generate(mixtral, PROMPTS, N, do_sample=False).tokens == greedy.tokens
    assert fj.generate(mixtral, PROMPTS, N).tokens == greedy.tokens


def test_conflicts_are_refused_by_generate(mixtral):
    with pytest.raises(ValueError, match="not both"):
        fj.generate(mixtral, PROMPTS, N, fj.Greedy(), temperature=0.5)
    with pytest.raises(ValueError, match="top_p"):
        fj.generate(mixtral, PROMPTS, N, top_p=2.0)


# -- the repetition penalty ------------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    """Greedy and top-1 sampling after the penalty pick what transformers' processor's logits make argmax."""
    import torch
    from transformers.generation import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    b, v = 3, 70  # 70 is not a multiple of the mask's 32-bit words
    changed = 0
    for penalty in (1.5, 0.7):
        for trial in range(10):
            logits = rng.normal(size=(b, v)).astype(np.float32) * 3
            seen_ids = [rng.choice(v, size=rng.integers(1, 40), replace=True) for _ in range(b)]
            # transformers takes one id list per row; equal lengths by repeating a row's first id
            width = max(len(s) for s in seen_ids)
            ids = torch.tensor(np.stack([np.pad(s, (0, width - len(s)), mode="edge") for s in seen_ids]))
            expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.tensor(logits)).argmax(-1).numpy()
            seen = np.zeros((b, v), bool)
            for row, s in enumerate(seen_ids):
                seen[row, s] = True
            key = sampler_key(np.asarray(jax.random.key_data(jax.random.key(trial))), seen)
            greedy = fj.Greedy(repetition_penalty=penalty)(jnp.asarray(logits), jnp.asarray(key))
            top1 = fj.Sample(top_k=1, repetition_penalty=penalty)(jnp.asarray(logits), jnp.asarray(key))
            np.testing.assert_array_equal(np.asarray(greedy), expected)
            np.testing.assert_array_equal(np.asarray(top1), expected)
            changed += int(np.sum(expected != logits.argmax(-1)))
    assert changed > 0  # the penalty decided some rows, so the comparison is not vacuous


def _penalised_argmax(logits: np.ndarray, seen: list[int], penalty: float) -> int:
    logits = logits.copy()
    held = np.unique(seen)
    logits[held] = np.where(logits[held] < 0, logits[held] * penalty, logits[held] / penalty)
    return int(np.argmax(logits))


def test_repetition_penalty_in_generation_follows_the_seen_tokens(mixtral):
    """Every greedy token with the penalty is the argmax of `forward`'s logits penalised at the prompt's and
    the earlier generated tokens, for each row of a batch of unequal prompts."""
    out = fj.generate(mixtral, PROMPTS, N, repetition_penalty=PENALTY, stop_at_eos=False)
    plain = fj.generate(mixtral, PROMPTS, N, stop_at_eos=False)
    assert out.tokens != plain.tokens  # the penalty changed something, so the check below is not vacuous
    for prompt, generated in zip(PROMPTS, out.tokens, strict=True):
        ids = mixtral.tokenizer(prompt)["input_ids"]
        logits = np.asarray(fj.forward(mixtral, [ids + generated[:-1]]))[0]
        for i, token in enumerate(generated):
            position = len(ids) - 1 + i
            assert token == _penalised_argmax(logits[position], ids + generated[:i], PENALTY), (prompt, i)


def test_repetition_penalty_offloaded_equals_resident(mixtral):
    with fj.load_model(
        "fmoe-tiny-mixtral", dtype="float32", offload=fj.OffloadConfig(cache_experts=5)
    ) as off:
        got = fj.generate(off, PROMPTS, N, repetition_penalty=PENALTY, stop_at_eos=False).tokens
    assert got == fj.generate(mixtral, PROMPTS, N, repetition_penalty=PENALTY, stop_at_eos=False).tokens


# -- prompt forms and chat templates ----------------------------------------------------------------------


def test_single_prompt_forms(mixtral):
    batch = fj.generate(mixtral, [PROMPTS[0]], N)
    assert fj.generate(mixtral, PROMPTS[0], N).tokens == batch.tokens
    ids = mixtral.tokenizer(PROMPTS[0])["input_ids"]
    assert fj.generate(mixtral, ids, N).tokens == batch.tokens
    assert fj.generate(mixtral, np.asarray(ids), N).tokens == batch.tokens
    assert fj.generate(mixtral, [ids, PROMPTS[1]], N).tokens == fj.generate(mixtral, PROMPTS, N).tokens


@pytest.mark.parametrize("name", ["fmoe-tiny-mixtral", "fmoe-tiny-qwen-moe"])
def test_chat_template_of_shipped_models(name, mixtral):
    model = mixtral if name == "fmoe-tiny-mixtral" else fj.load_model(name)
    assert model.tokenizer.chat_template == CHAT_TEMPLATE
    rendered = model.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s>SYSTEM:\nYou are brief.\n\nUSER:\nWho is the king?\n\nASSISTANT:\n"
    ids = model.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == model.tokenizer.bos_token_id and ids.count(model.tokenizer.bos_token_id) == 1
    short = model.tokenizer.apply_chat_template(CHAT[1:], add_generation_prompt=True, tokenize=False)
    short_ids = model.tokenizer(short, add_special_tokens=False)["input_ids"]
    assert encode_prompts(model, CHAT) == [ids]  # one conversation
    assert encode_prompts(model, [CHAT, CHAT[1:]]) == [ids, short_ids]  # a batch of them
    if model is mixtral:  # what the template renders is generated as its ids are (compiling one model)
        expected = fj.generate(model, [ids, short_ids], N).tokens
        assert fj.generate(model, [CHAT, CHAT[1:]], N).tokens == expected


def test_chat_errors(mixtral):
    with pytest.raises(ValueError, match="message 1 must be a dict with a 'role' string and a 'content'"):
        fj.generate(mixtral, [{"role": "user", "content": "hi"}, {"text": "no role"}], N)
    template = mixtral.tokenizer.chat_template
    mixtral.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            fj.generate(mixtral, CHAT, N)
    finally:
        mixtral.tokenizer.chat_template = template


# -- stop rules ------------------------------------------------------------------------------------------


def test_eos_token_id_and_stop_strings(mixtral):
    free = fj.generate(mixtral, PROMPTS[0], N, stop_at_eos=False)
    tokens, text = free.tokens[0], free.texts[0]
    assert free.finish_reasons == ["length"]
    eos = tokens[5]
    other = next(t for t in range(mixtral.config.vocab_size) if t not in tokens)
    first = tokens.index(eos)
    out = fj.generate(mixtral, PROMPTS[0], N, eos_token_id=eos)
    assert out.tokens[0] == tokens[: first + 1] and out.finish_reasons == ["eos"]
    assert fj.generate(mixtral, PROMPTS[0], N, eos_token_id=[other, eos]).tokens == out.tokens

    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = fj.generate(mixtral, PROMPTS[0], N, stop=["\x00never", stop], stop_at_eos=False)
    assert out.finish_reasons == ["stop"]
    n = len(out.tokens[0])
    assert out.tokens[0] == tokens[:n]
    decode = mixtral.tokenizer.decode
    assert stop in decode(tokens[:n]) and stop not in decode(tokens[: n - 1])


# -- log-probabilities -----------------------------------------------------------------------------------


def test_logprobs_equal_log_softmax_of_forward(mixtral):
    out = fj.generate(
        mixtral, PROMPTS, N, seed=1, return_logprobs=True, top_logprobs=4, stop_at_eos=False, **SAMPLED
    )
    for row, prompt in enumerate(PROMPTS):
        ids, generated = mixtral.tokenizer(prompt)["input_ids"], out.tokens[row]
        logits = fj.forward(mixtral, [ids + generated[:-1]])[0, len(ids) - 1 :]  # [n, V]
        chex.assert_shape(logits, (len(generated), mixtral.config.vocab_size))
        chex.assert_type(logits, jnp.float32)
        expected = jax.nn.log_softmax(logits, axis=-1)
        chosen = np.asarray(expected)[np.arange(len(generated)), generated]
        chex.assert_trees_all_close(np.asarray(out.logprobs[row]), chosen, atol=1e-5, rtol=0)
        for step, top in enumerate(out.top_logprobs[row]):
            ids_top, values = zip(*top, strict=True)
            best = np.argsort(-np.asarray(expected[step]), kind="stable")[:4]
            assert set(ids_top) == set(best.tolist())
            assert list(values) == sorted(values, reverse=True)
            np.testing.assert_allclose(values, np.asarray(expected[step])[list(ids_top)], rtol=0, atol=1e-5)
    assert fj.generate(mixtral, PROMPTS, N).logprobs is None


# -- streaming -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(temperature=0.9, top_p=0.95, seed=5)], ids=["greedy", "sampled"]
)
def test_generate_stream_yields_what_generate_returns(mixtral, kwargs):
    expected = fj.generate(mixtral, PROMPTS, N, **kwargs)
    stream = fj.generate_stream(mixtral, PROMPTS, N, **kwargs)
    pieces = list(stream)
    for row in range(len(PROMPTS)):
        mine = [p for p in pieces if p.row == row]
        assert [p.token for p in mine] == expected.tokens[row]
        assert "".join(p.text for p in mine) == expected.texts[row]
        assert [p.finish_reason for p in mine][-1] == expected.finish_reasons[row]
        assert all(p.finish_reason is None for p in mine[:-1])
    assert stream.output.tokens == expected.tokens and stream.output.texts == expected.texts
    assert stream.output.stats.new_tokens == sum(map(len, expected.tokens))


def test_generate_stream_shows_generates_options():
    """help() and editors see the stream's options: generate's own, less `streamer`."""
    import inspect

    stream = inspect.signature(fj.generate_stream).parameters
    generate = inspect.signature(fj.generate).parameters
    assert list(stream) == [name for name in generate if name != "streamer"]
    assert stream["max_new_tokens"].default == generate["max_new_tokens"].default


def test_stream_validates_before_the_first_token_and_output_waits(mixtral):
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        fj.generate_stream(mixtral, PROMPTS, 0)
    stream = fj.generate_stream(mixtral, PROMPTS[0], N)
    with pytest.raises(RuntimeError, match="iterate over it to the end"):
        stream.output  # noqa: B018


def test_streamer_callback_and_transformers_streamer(mixtral, capsys):
    import transformers

    pieces = []
    out = fj.generate(mixtral, PROMPTS, N, streamer=pieces.append)
    assert [p.token for p in pieces if p.row == 1] == out.tokens[1]
    fj.generate(
        mixtral, PROMPTS[0], N, streamer=transformers.TextStreamer(mixtral.tokenizer, skip_prompt=True)
    )
    printed = capsys.readouterr().out
    assert printed.strip() == fj.generate(mixtral, PROMPTS[0], N).texts[0].strip()
    with pytest.raises(ValueError, match="streamer must be a callable"):
        fj.generate(mixtral, PROMPTS[0], N, streamer=42)


def test_text_pieces_complete_multibyte_characters(mixtral):
    """A byte-level token can end inside a character: no piece holds a replacement character, and the
    pieces still add up to the decoded text."""
    from fmoe_jax.streaming import TextPieces

    text = "Grüße, 東京 and ☃!"
    ids = mixtral.tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = TextPieces(mixtral.tokenizer)
    out = [pieces.add(t) for t in ids]
    assert "".join(out) == text and not any("\ufffd" in p for p in out)
    assert "" in out  # some token ended mid-character, so this exercised the hold-back
