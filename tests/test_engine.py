"""The CPU sampling engine against a direct forward pass of a real (tiny, random) transformers model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dataclasses import replace  # noqa: E402

from rlgate.inference.engine import Engine, SamplingParams, processed_logits  # noqa: E402

VOCAB, PAD, EOS = 300, 0, 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, pad_token_id=PAD, eos_token_ids=(EOS,), logprobs_mode="processed_logprobs")


PROMPTS = [[5, 17, 42, 99, 7, 3], [250, 11], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def direct_logprobs(model, prompt, completion, params):
    """log p(token) of each completion token from one unpadded forward pass over prompt + completion."""
    ids = torch.tensor([prompt + completion[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    out = []
    for i, token in enumerate(completion):
        z = processed_logits(logits[len(prompt) - 1 + i], params)
        out.append(float(torch.log_softmax(z, -1)[token]))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, temperature=0.7, seed=1),
        SamplingParams(
            max_tokens=8, temperature=1.3, top_k=7, top_p=0.8, seed=2, logit_bias={12: 3.0, 40: -2.0}
        ),
        SamplingParams(max_tokens=8, temperature=0, seed=3),
    ],
)
def test_logprobs_are_those_of_the_sampled_distribution(model, engine, params):
    outs = engine.generate(PROMPTS, [params] * len(PROMPTS))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) > 0
        expected = direct_logprobs(model, prompt, out.token_ids, params)
        assert out.logprobs == pytest.approx(expected, abs=2e-4)


def test_a_row_does_not_depend_on_its_batch(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    alone = engine.generate([PROMPTS[1]], [params])[0]
    batched = engine.generate(PROMPTS, [SamplingParams(max_tokens=10, seed=s) for s in (1, 7, 3)])[1]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=2e-4)
    again = engine.generate([PROMPTS[1]], [params])[0]
    assert again.token_ids == alone.token_ids  # seeded: reproducible
    other = engine.generate([PROMPTS[1]], [SamplingParams(max_tokens=10, temperature=1.0, seed=8)])[0]
    assert other.token_ids != alone.token_ids


def test_greedy_matches_transformers_generate(model, engine):
    out = engine.generate([PROMPTS[0]], [SamplingParams(max_tokens=12, temperature=0)])[0]
    reference = model.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=PAD
    )[0, len(PROMPTS[0]) :].tolist()
    assert out.token_ids == reference


def test_logit_bias_stops_and_lengths(engine):
    forced = engine.generate([PROMPTS[0]], [SamplingParams(max_tokens=5, logit_bias={77: 100.0}, seed=0)])[0]
    assert forced.token_ids == [77] * 5 and forced.finish_reason == "length"
    assert forced.logprobs == pytest.approx([0.0] * 5, abs=1e-6)
    stopped = engine.generate([PROMPTS[0]], [SamplingParams(max_tokens=5, logit_bias={EOS: 100.0})])[0]
    assert stopped.token_ids == [EOS] and stopped.finish_reason == "stop" and stopped.stop_token_id == EOS
    custom = engine.generate(
        [PROMPTS[0]], [SamplingParams(max_tokens=5, logit_bias={9: 100.0}, stop_token_ids=(9,))]
    )[0]
    assert custom.token_ids == [9] and custom.finish_reason == "stop"
    never = engine.generate(
        [PROMPTS[0]],
        [SamplingParams(max_tokens=20, temperature=0, logit_bias={t: -100.0 for t in range(100, 300)})],
    )[0]
    assert all(t < 100 for t in never.token_ids)


def test_top_logprobs(engine):
    out = engine.generate([PROMPTS[2]], [SamplingParams(max_tokens=4, top_logprobs=3, seed=5)])[0]
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert top[0] == (token, pytest.approx(logprob)) and len(top) == 3
        assert [lp for _, lp in top[1:]] == sorted((lp for _, lp in top[1:]), reverse=True)


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    z = processed_logits(logits, SamplingParams(top_k=2))
    assert torch.isinf(z[2:]).all() and torch.isfinite(z[:2]).all()
    probs = torch.softmax(logits, -1)  # 0.636, 0.234, 0.086, ...: the top two reach 0.87
    z = processed_logits(logits, SamplingParams(top_p=0.8))
    assert torch.isfinite(z[:2]).all() and torch.isinf(z[2:]).all() and probs[:2].sum() > 0.8
    z = processed_logits(logits, SamplingParams(top_p=0.5))
    assert torch.isfinite(z[0]) and torch.isinf(z[1:]).all()
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_scheduler_batches_concurrent_requests(engine):
    import asyncio

    from rlgate.inference.scheduler import Scheduler

    params = [SamplingParams(max_tokens=6, seed=i) for i in range(12)]
    prompts = [PROMPTS[i % 3] for i in range(12)]

    async def go():
        scheduler = Scheduler(engine, window_s=0.01)
        scheduler.start()
        try:
            results = await asyncio.gather(
                *(scheduler.generate(p, q) for p, q in zip(prompts, params, strict=True))
            )
        finally:
            await scheduler.aclose()
        return results, scheduler.batches

    results, batches = asyncio.run(go())
    assert batches < 12  # they shared forward passes
    direct = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == [d.token_ids for d in direct]


def test_engine_on_the_tiny_model_built_by_the_cli(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "-m", "rlgate", "make-tiny-model", str(path), "--seed", "3"],
        check=True,
        capture_output=True,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    engine = Engine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    prompt = tokenizer.encode(text)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    [out] = engine.generate([prompt], [SamplingParams(max_tokens=4, logit_bias={end: 100.0})])
    assert out.token_ids == [end] and out.finish_reason == "stop"
    [free] = engine.generate([prompt], [SamplingParams(max_tokens=6, seed=0)])
    assert len(free.token_ids) >= 1 and len(free.logprobs) == len(free.token_ids)
    assert free.logprobs == pytest.approx(
        direct_logprobs(model, prompt, free.token_ids, SamplingParams()), abs=2e-4
    )


def test_a_stop_callback_ends_its_row_and_no_other(engine):
    params = [SamplingParams(max_tokens=12, seed=1), SamplingParams(max_tokens=12, seed=2)]
    free = engine.generate(PROMPTS[:2], params)
    calls = []

    def third(ids):
        calls.append(list(ids))
        return len(ids) == 3

    stopped = engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=12, seed=1, stop=third), params[1]])
    assert stopped[0].token_ids == free[0].token_ids[:3] and stopped[0].finish_reason == "stop"
    assert calls == [free[0].token_ids[:1], free[0].token_ids[:2], free[0].token_ids[:3]]
    assert stopped[1].token_ids == free[1].token_ids  # its batch neighbour is untouched


def test_stop_strings_end_generation_where_the_answer_is_cut(tmp_path):
    """`rlgate serve`'s model stops a row at the token whose text completes a stop string: the same
    answer as running to max_tokens and cutting afterwards, with no tokens generated past the cut."""
    import asyncio
    import random
    import subprocess
    import sys

    from rlgate.inference.model import Model

    path = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "-m", "rlgate", "make-tiny-model", str(path), "--seed", "3"],
        check=True,
        capture_output=True,
    )
    model = Model(path, "tiny", batch_window_s=0.0)
    prompt = model.tokenizer.encode("hello there")
    rng = random.Random(0)

    async def go():
        model.scheduler.start()
        try:
            cases = 0
            for seed in range(12):
                params = SamplingParams(max_tokens=40, seed=seed, temperature=1.0)
                whole = await model.generate(prompt, params, [])
                if len(whole.text) < 6:
                    continue
                # a random byte-level model writes invalid UTF-8 too (U+FFFD in the text): stop strings
                # holding U+FFFD are cut afterwards only, by design, so take ones without it
                candidates = [
                    whole.text[i : i + n]
                    for i in range(len(whole.text) - 3)
                    for n in (1, 2, 3)
                    if "\ufffd" not in whole.text[i : i + n]
                ]
                if not candidates:
                    continue
                stop = rng.choice(candidates)
                late = model.finish(model.engine.generate([prompt], [params])[0], params, [stop])
                early = await model.generate(prompt, params, [stop])  # with the early stop
                assert early == late, (seed, stop)
                assert early.finish_reason == "stop" and early.stop_reason == stop
                sampled = model.engine.generate([prompt], [replace(params, stop=model._stop_check([stop]))])[
                    0
                ]
                assert sampled.token_ids == early.token_ids  # nothing generated past the cut
                cases += 1
            return cases
        finally:
            await model.scheduler.aclose()

    assert asyncio.run(go()) >= 6


def test_temperatures_below_vllms_floor_are_raised_to_it():
    """vLLM's SamplingParams raises 0 < T < 0.01 to 0.01 (z / T stays finite); 0 stays greedy."""
    assert [SamplingParams(temperature=t).temperature for t in (1e-45, 1e-3, 0.0099, 0.01, 0.5, 0.0)] == [
        0.01,
        0.01,
        0.01,
        0.01,
        0.5,
        0.0,
    ]
    z = processed_logits(torch.tensor([50.0, 10.0, -30.0]), SamplingParams(temperature=1e-45))
    assert torch.isfinite(z).all() and z.tolist() == pytest.approx([5000.0, 1000.0, -3000.0])


def test_one_rows_failure_does_not_fail_its_batch_mates(engine):
    """A row whose sampling raises (here: a logit_bias id past the vocabulary, a stop callback that raises)
    fails alone; the tiny temperature that used to overflow z / T samples like T = 0.01; through the
    scheduler, only the failing requests raise."""
    import asyncio

    from rlgate.inference.scheduler import Scheduler

    def broken(ids):
        raise RuntimeError("stop callback bug")

    normal = SamplingParams(max_tokens=6, seed=4)
    tiny_t = SamplingParams(max_tokens=6, seed=5, temperature=1e-45)
    rows = [
        SamplingParams(max_tokens=6, logit_bias={10 * VOCAB: 1.0}),
        normal,
        tiny_t,
        SamplingParams(max_tokens=6, seed=6, stop=broken),
    ]
    prompts = [PROMPTS[i % 3] for i in range(len(rows))]
    out = engine.generate(prompts, rows)
    assert [o.finish_reason for o in out] == ["error", "length", "length", "error"]
    assert isinstance(out[0].error, IndexError) and isinstance(out[3].error, RuntimeError)
    assert out[1].token_ids == engine.generate([prompts[1]], [normal])[0].token_ids
    floor = engine.generate([prompts[2]], [SamplingParams(max_tokens=6, seed=5, temperature=0.01)])[0]
    assert out[2].token_ids == floor.token_ids and out[2].error is None

    async def go():
        scheduler = Scheduler(engine, window_s=0.05)
        scheduler.start()
        try:
            return await asyncio.gather(
                *(scheduler.generate(p, q) for p, q in zip(prompts, rows, strict=True)),
                return_exceptions=True,
            )
        finally:
            await scheduler.aclose()

    results = asyncio.run(go())
    assert isinstance(results[0], IndexError) and isinstance(results[3], RuntimeError)
    assert results[1].token_ids == out[1].token_ids and results[2].token_ids == out[2].token_ids


def test_one_logprobs_mode_default_everywhere(model):
    """vLLM's default (raw_logprobs) for the engine, its sampler, the model, the LoRA adapters and the server."""
    import inspect

    from rlgate.inference.engine import sample
    from rlgate.inference.lora import Adapters
    from rlgate.inference.model import Model
    from rlgate.inference.server import build_app

    defaults = {
        f.__qualname__: inspect.signature(f).parameters["logprobs_mode"].default
        for f in (Engine, sample, Model, Adapters, build_app)
    }
    from rlgate.cli import ServeCommand

    defaults["rlgate serve --logprobs-mode"] = ServeCommand.model_fields["logprobs_mode"].default
    assert set(defaults.values()) == {"raw_logprobs"}, defaults
    assert Engine(model, pad_token_id=PAD, eos_token_ids=(EOS,)).logprobs_mode == "raw_logprobs"


def test_a_closed_scheduler_fails_its_running_batch_and_a_drained_one_finishes_it(engine):
    """aclose() while a batch is in the engine: its requests fail at once instead of hanging; drain()
    lets queued and running requests finish on the same weights, then stops."""
    import asyncio
    import time

    from rlgate.inference.scheduler import Scheduler

    params = SamplingParams(max_tokens=48, seed=3)

    async def in_the_engine(scheduler: Scheduler) -> asyncio.Task:
        request = asyncio.create_task(scheduler.generate(PROMPTS[0], params))
        deadline = time.monotonic() + 30
        while not scheduler.running:  # polled every event-loop turn: the batch takes many of them
            assert time.monotonic() < deadline and not request.done(), "the batch never ran"
            await asyncio.sleep(0)
        return request

    async def go():
        closed = Scheduler(engine, window_s=0.001)
        closed.start()
        request = await in_the_engine(closed)
        await closed.aclose()
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(request, timeout=30)
        with pytest.raises(RuntimeError, match="shutting down"):  # and one that comes later
            await asyncio.wait_for(closed.generate(PROMPTS[1], params), timeout=30)
        drained = Scheduler(engine, window_s=0.001)
        drained.start()
        request = await in_the_engine(drained)
        queued = asyncio.create_task(drained.generate(PROMPTS[1], params))
        await asyncio.sleep(0)
        await asyncio.wait_for(drained.drain(), timeout=60)
        return request.result(), queued.result(), drained._task.done()

    first, second, stopped = asyncio.run(go())
    assert first.token_ids and second.token_ids and stopped
    assert first.finish_reason in ("length", "stop") and second.finish_reason in ("length", "stop")
