"""The server through the official `openai` client: what a user of an OpenAI-compatible server relies on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from openai import AsyncStream

PROMPTS = [f"def {name}(" for name in ("fibonacci", "parse_args", "main", "read_file", "sort_items", "merge",
                                      "__init__", "to_json", "validate", "run", "connect", "tokenize", "flatten",
                                      "retry", "is_prime", "render")]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def chat(server, prompt: str, **kw):
    return server.client().chat.completions.create(model=server.model(),
                                                   messages=[{"role": "user", "content": prompt}], **kw)


def complete(server, prompt, **kw):
    return server.client().completions.create(model=server.model(), prompt=prompt, **kw)


def test_models_health_ready_version(server):
    models = server.client().models.list().data
    assert len(models) == 1 and models[0].object == "model"
    assert server.http.get(f"{server.url}/health").status_code == 200
    assert server.http.get(f"{server.url}/ready").status_code == 200
    assert server.http.get(f"{server.url}/version").json()["version"]


def test_chat_completion_with_usage(server):
    r = chat(server, PROMPTS[0], max_tokens=12, **GREEDY)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12 == len(choice.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_max_completion_tokens_wins_over_max_tokens(server):
    r = chat(server, PROMPTS[0], max_tokens=3, max_completion_tokens=5, **GREEDY)
    assert r.usage.completion_tokens == 5


def test_streaming_equals_non_streaming(server):
    full = chat(server, PROMPTS[1], max_tokens=20, **GREEDY)
    chunks = list(chat(server, PROMPTS[1], max_tokens=20, stream=True, stream_options={"include_usage": True},
                       **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(server):
    full = complete(server, PROMPTS[2], max_tokens=16, **GREEDY)
    assert full.object == "text_completion" and full.usage.completion_tokens == 16
    streamed = complete(server, PROMPTS[2], max_tokens=16, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text


def test_completion_echo_prepends_the_prompt(server):
    plain = complete(server, PROMPTS[2], max_tokens=6, temperature=0).choices[0].text
    echoed = complete(server, PROMPTS[2], max_tokens=6, temperature=0, echo=True).choices[0].text
    assert echoed == PROMPTS[2] + plain


def test_sse_framing_ends_with_done(server):
    body = {"model": server.model(), "prompt": PROMPTS[0], "max_tokens": 8, "stream": True}
    with server.http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    json.loads(events[0].removeprefix("data: "))


def generate_cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddtree.cli", "generate", "--json", *args],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_greedy_output_equals_ddtree_generate(server):
    cli = generate_cli("--prompt", PROMPTS[3], "--max-new-tokens", "24")
    r = complete(server, PROMPTS[3], max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == cli["token_ids"] and r.choices[0].text == cli["text"]
    assert r.choices[0].finish_reason == cli["finish_reason"]
    cli = generate_cli("--prompt", PROMPTS[4], "--chat", "--max-new-tokens", "24")
    r = chat(server, PROMPTS[4], max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == cli["token_ids"] and r.choices[0].message.content == cli["text"]


def test_stop_string_cuts_before_it_and_is_never_emitted(server):
    full = complete(server, PROMPTS[5], max_tokens=24, **GREEDY).choices[0]
    middle = len(full.text) // 2
    stop = full.text[middle:middle + 3]
    expected = full.text[:full.text.index(stop)]
    for stream in (False, True):
        r = complete(server, PROMPTS[5], max_tokens=24, stop=[stop, "never-there"], stream=stream, **GREEDY)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            final = chunks[-1].choices[0]
        else:
            text, final = r.choices[0].text, r.choices[0]
        assert text == expected and stop not in text
        assert final.finish_reason == "stop" and final.stop_reason == stop


def test_stop_token_id_ends_the_output_without_it(server):
    full = complete(server, PROMPTS[6], max_tokens=24, **GREEDY).choices[0]
    stop_id = full.token_ids[len(full.token_ids) // 2]
    cut = full.token_ids.index(stop_id)
    r = complete(server, PROMPTS[6], max_tokens=24, temperature=0,
                 extra_body={"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].token_ids == full.token_ids[:cut]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop_id
    assert r.usage.completion_tokens == cut


def test_seed_makes_sampling_reproducible(server):
    def sample(seed: int) -> list[int]:
        r = complete(server, PROMPTS[7], max_tokens=12, temperature=1.0, seed=seed,
                     extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].token_ids

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_n_choices_are_independent_samples_and_choice_0_is_the_single_reply(server):
    kw = dict(max_tokens=10, temperature=1.0, seed=77, extra_body={"ignore_eos": True, "return_token_ids": True})
    single = complete(server, PROMPTS[9], **kw).choices[0].token_ids
    r = complete(server, PROMPTS[9], n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.choices[0].token_ids == single  # choice i draws with seed + i
    assert len({tuple(c.token_ids) for c in r.choices}) > 1
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == len(r.prompt_token_ids)
    assert [c.token_ids for c in complete(server, PROMPTS[9], n=3, **kw).choices] == [c.token_ids
                                                                                       for c in r.choices]
    greedy = chat(server, PROMPTS[10], max_tokens=8, n=2, **GREEDY)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content == chat(
        server, PROMPTS[10], max_tokens=8, **GREEDY).choices[0].message.content


def test_n_choices_stream_interleaved_by_index(server):
    kw = dict(max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    full = chat(server, PROMPTS[11], n=2, **kw)
    chunks = list(chat(server, PROMPTS[11], n=2, stream=True, stream_options={"include_usage": True}, **kw))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == full.choices[index].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 24


def test_tokenize_gives_the_ids_the_completion_endpoints_decode_from(server):
    def post(path: str, body: dict):
        return server.http.post(f"{server.url}{path}", json=body)

    r = complete(server, PROMPTS[12], max_tokens=2, **GREEDY)
    tokens = post("/tokenize", {"prompt": PROMPTS[12]}).json()
    assert tokens["tokens"] == r.prompt_token_ids and tokens["count"] == r.usage.prompt_tokens
    assert tokens["max_model_len"] == server.http.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    messages = [{"role": "user", "content": PROMPTS[12]}]
    assert post("/tokenize", {"messages": messages}).json()["count"] == chat(
        server, PROMPTS[12], max_tokens=2, **GREEDY).usage.prompt_tokens
    assert post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": PROMPTS[12]}
    both = post("/tokenize", {"prompt": "x", "messages": messages})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    assert post("/detokenize", {"tokens": [-1]}).status_code == 400


def test_logit_bias_and_penalties_shape_the_output(server):
    base = complete(server, PROMPTS[13], max_tokens=8, **GREEDY).choices[0].token_ids
    target = next(t for t in range(5, 50) if t not in base)
    biased = complete(server, PROMPTS[13], max_tokens=8, logit_bias={str(target): 100}, **GREEDY)
    assert biased.choices[0].token_ids == [target] * 8  # +100 wins every argmax
    # Penalties: the server's ddtree reply is the target's own AR decoding under the same penalties.
    from ddtree.core.sampling import SamplingParams
    from ddtree.engine import Engine

    kw = {**GREEDY, "extra_body": {**GREEDY["extra_body"], "repetition_penalty": 1.3}}
    penalized = complete(server, PROMPTS[13], max_tokens=24, frequency_penalty=1.0, presence_penalty=0.5, **kw)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
                            repetition_penalty=1.3)
    demo = Engine.from_pretrained(device="cpu")
    ar = demo.generate(penalized.prompt_token_ids, params, method="ar").token_ids
    assert penalized.choices[0].token_ids == ar
    assert ar != complete(server, PROMPTS[13], max_tokens=24, **GREEDY).choices[0].token_ids


def test_chat_logprobs_are_the_targets_distribution(server):
    r = chat(server, PROMPTS[8], max_tokens=10, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 10
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        # Greedy: the emitted token is the target's argmax.
        assert entry.logprob == pytest.approx(tops[0]) and entry.token == entry.top_logprobs[0].token
    joined = "".join(e.token for e in content)
    assert joined.replace(" ", "") == r.choices[0].message.content.replace(" ", "")


def test_completion_logprobs_match_chat_shape_and_offsets(server):
    r = complete(server, PROMPTS[8], max_tokens=6, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(chosen)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


def test_echo_with_logprobs_scores_the_prompt_with_the_target(server):
    """What evaluation harnesses send to score a text: echo + logprobs gives each prompt token's target
    log-probability (the first has none), then the completion's; vLLM's prompt_logprobs the same numbers."""
    import torch
    from ddtree.engine import Engine

    text = "def fibonacci(n):\n    return n"
    r = complete(server, text, max_tokens=2, logprobs=2, echo=True, **GREEDY)
    lp = r.choices[0].logprobs
    engine = Engine.from_pretrained(device="cpu")  # the server's demo pair, scored directly
    ids = engine.encode(text)
    with torch.no_grad():
        want = engine.target.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
    assert "".join(lp.tokens[:len(ids)]) == text and r.choices[0].text.startswith(text)
    vllm = complete(server, text, max_tokens=1, extra_body={"prompt_logprobs": 1}).choices[0].model_extra
    scored = vllm["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for i in range(1, len(ids)):
        entry = scored[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[i], abs=1e-5)
        assert entry["rank"] == 1 + int((want[i - 1] > want[i - 1, ids[i]]).sum())
    streamed = server.http.post(f"{server.url}/v1/completions", json={
        "model": server.model(), "prompt": text, "echo": True, "logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "echo"


def test_spec_stats_are_opt_in_and_consistent(server):
    plain = complete(server, PROMPTS[9], max_tokens=16, temperature=0)
    assert "metrics" not in plain.model_extra
    r = complete(server, PROMPTS[9], max_tokens=16, temperature=0, extra_body={"return_spec_stats": True})
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert spec["method"] == "ddtree" and spec["num_verify_rounds"] == sum(spec["accepted_length_histogram"])
    assert spec["acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_verify_rounds"])
    # The prefill emits one token; every verify round commits its accepted tokens plus one bonus.
    assert r.usage.completion_tokens <= 1 + spec["num_verify_rounds"] + spec["num_accepted_tokens"]


@pytest.mark.slow
def test_sixteen_concurrent_clients_all_get_their_own_output(server):
    prompts = PROMPTS[:4] * 4  # four clients per prompt: any cross-talk between requests shows
    expected = {p: complete(server, p, max_tokens=8, **GREEDY).choices[0].token_ids for p in PROMPTS[:4]}

    async def run_all():
        client = server.async_client()
        name = (await client.models.list()).data[0].id
        calls = [client.completions.create(model=name, prompt=p, max_tokens=8, stream=i % 2 == 0, **GREEDY)
                 for i, p in enumerate(prompts)]
        results = await asyncio.gather(*calls)
        out = []
        for r in results:
            if isinstance(r, AsyncStream):
                out.append([t async for c in r for t in getattr(c.choices[0], "token_ids", None) or []])
            else:
                out.append(r.choices[0].token_ids)
        return out

    assert asyncio.run(run_all()) == [expected[p] for p in prompts]
