"""The model's own sampling defaults (vLLM's `--generation-config auto`): a request that leaves out
temperature, top_p, top_k, min_p or repetition_penalty gets the value the checkpoint's generation_config.json
sets; what a request sends wins, `--default-temperature` wins over the file's temperature, and
`--generation-config none` (or `vllm`) ignores the file."""

from __future__ import annotations

import logging

import pytest
from ddtree.api.app import create_app
from ddtree.api.config import ServerConfig
from ddtree.engine import Engine
from fastapi.testclient import TestClient
from scripted_engine import ScriptedEngine, prefill, round_
from servers import wait_ready
from tiny import make_target

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
NEUTRAL = (1.0, 1.0, 0, 0.0, 1.0)


def sampling(params) -> tuple:
    return tuple(getattr(params, k) for k in SAMPLING)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Engine]:
    """Tiny targets with Qwen3's sampling defaults, with `do_sample: false`, and with none (as today)."""
    root = tmp_path_factory.mktemp("generation-config")
    configs = {"qwen3": QWEN3, "greedy_flag": {"do_sample": False, "temperature": 0.7, "min_p": 0.05,
                                               "repetition_penalty": 1.05}, "plain": None}
    return {name: Engine.from_pretrained(make_target(root / name, generation_config=config), method="ar",
                                         device="cpu") for name, config in configs.items()}


def received(engine: Engine, bodies: list[dict], **config) -> list[tuple]:
    """The sampling fields the engine gets for each completions body, through the HTTP app."""
    seen = []
    request = engine.request

    def record(prompt_ids, params, **kw):
        seen.append(sampling(params))
        return request(prompt_ids, params, **kw)

    engine.request = record
    try:
        with TestClient(create_app(lambda: engine, ServerConfig(**config))) as client:
            wait_ready(client)
            for body in bodies:
                r = client.post("/v1/completions",
                                json={"model": engine.model_name, "prompt": [1, 2, 3], "max_tokens": 2, **body})
                assert r.status_code == 200, r.text
    finally:
        del engine.request
    return seen


def test_a_request_gets_the_checkpoints_values_for_what_it_leaves_out(targets):
    bodies = [{}, {"temperature": 0.2}, {"temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1,
                                         "repetition_penalty": 1.2}]
    assert received(targets["qwen3"], bodies) == [(0.6, 0.95, 20, 0.0, 1.0), (0.2, 0.95, 20, 0.0, 1.0),
                                                  (0.0, 0.5, 0, 0.1, 1.2)]


def test_do_sample_false_is_ignored_as_vllm_ignores_it(targets):
    assert targets["greedy_flag"].generation_defaults == {"temperature": 0.7, "min_p": 0.05,
                                                          "repetition_penalty": 1.05}
    assert received(targets["greedy_flag"], [{}]) == [(0.7, 1.0, 0, 0.05, 1.05)]


@pytest.mark.parametrize("setting", ["none", "vllm"])
def test_generation_config_none_ignores_the_file(targets, setting):
    assert received(targets["qwen3"], [{}, {"top_k": 5}], generation_config=setting) == [
        NEUTRAL, (1.0, 1.0, 5, 0.0, 1.0)]


def test_a_checkpoint_without_sampling_values_behaves_as_before(targets):
    assert targets["plain"].generation_defaults == {}
    assert received(targets["plain"], [{}]) == [NEUTRAL]
    assert received(targets["plain"], [{}], default_temperature=0.0) == [(0.0, 1.0, 0, 0.0, 1.0)]


def test_default_temperature_wins_over_the_files_temperature_only(targets):
    assert received(targets["qwen3"], [{}, {"temperature": 0.3}], default_temperature=0.0) == [
        (0.0, 0.95, 20, 0.0, 1.0), (0.3, 0.95, 20, 0.0, 1.0)]


def test_the_applied_defaults_are_logged_once_at_startup(targets, caplog):
    with caplog.at_level(logging.INFO, logger="ddtree.server"):
        received(targets["qwen3"], [{}, {}])
        received(targets["qwen3"], [{}], generation_config="none")
        received(targets["plain"], [{}])
    lines = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    assert lines == ["default sampling parameters from the model's generation_config.json: temperature=0.6, "
                     "top_p=0.95, top_k=20 (fields a request sends win; --generation-config none ignores the file)"]


class ChatEngine(ScriptedEngine):
    """A scripted engine that renders chats (to one fixed prompt)."""

    tokenizer = type("Tokenizer", (), {"chat_template": ""})()

    def chat_ids(self, messages, **kwargs) -> list[int]:
        return [0, 1]


def test_chat_and_completions_share_the_defaults():
    engine = ChatEngine()
    engine.generation_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    engine.scripts = [[prefill(0), round_([1], "length")] for _ in range(4)]
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(create_app(lambda: engine)) as client:
        wait_ready(client)
        for path, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": [0]})):
            for extra in ({}, {"top_p": 0.8, "top_k": 0}):
                r = client.post(path, json={**body, "model": "scripted", "max_tokens": 2, **extra})
                assert r.status_code == 200, r.text
    assert [sampling(p) for p in engine.params] == [(0.6, 0.95, 20, 0.0, 1.0), (0.6, 0.8, 0, 0.0, 1.0)] * 2


def test_a_bad_value_in_the_file_stops_loading(tmp_path):
    from ddtree.errors import DDTreeError

    make_target(tmp_path / "bad", generation_config={"top_p": 0})
    with pytest.raises(DDTreeError, match=r"generation_config\.json has an invalid sampling value: top_p must be"):
        Engine.from_pretrained(tmp_path / "bad", method="ar", device="cpu")


def test_serve_passes_the_flag_to_the_server(monkeypatch):
    from ddtree.api import serve
    from ddtree.cli import main

    configs = []

    def capture(load, config, on_load_error):
        configs.append(config)
        return create_app(load, config, on_load_error)

    monkeypatch.setattr(serve, "create_app", capture)
    monkeypatch.setattr(serve._DrainingServer, "run", lambda self: None)
    assert main(["serve"]) == 0
    assert main(["serve", "--generation-config", "vllm", "--default-temperature", "0.5"]) == 0
    assert [(c.generation_config, c.default_temperature) for c in configs] == [("auto", None), ("vllm", 0.5)]
    with pytest.raises(SystemExit):
        main(["serve", "--generation-config", "hf"])
