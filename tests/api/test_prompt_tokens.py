"""The tokenization prefix cache gives exactly `tokenizer.encode(text, add_special_tokens=False)`: over random
texts with every kind of character and added tokens at would-be cuts, for the demo tokenizer and byte-level BPEs
of each recognised regex built here; every safe point splits a text exactly; tokenizers it does not recognise pass
through; served prompts (completions and chat) get the ids they got before, their shared prefix from the cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ddtree.api import prompt_tokens
from ddtree.api.app import create_app
from ddtree.api.prompt_tokens import MIN_CHARS, STRIDE, PromptTokens
from ddtree.engine import Engine
from ddtree.engine.engine import ASSETS
from fastapi.testclient import TestClient
from servers import wait_ready
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

WORDS = ["the", "a", "prompt", "tokens", "cache", "Prefix", "QUERY", "x", "I", "foo", "new", "york", "don't",
         "it's", "we'll", "THEY'RE", "O'Neil", "'s", "café", "naïve", "Straße", "Ωmega", "日本語", "e\u0301te\u0301",
         "ﬁle", "ǅemo", "def", "return", "self", "print"]
GAPS = [" "] * 12 + ["  ", "   ", "\n", "\n\n", "\t", " \t", "\r\n", " \n ", ", ", ". ", "; ", "'", " '", "-", "(",
                     ")", '"', "...", " 42 ", "2024", "3.14159", "1234567", "😀", " 😀 ", "\u0301", " \u0301",
                     "\u00a0", "\u3000", " \u200b", "_", "=", " = ", "#"]
ADDED = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<mask>", "foo", "new york"]  # the built tokenizers' own
AROUND = ["{}", " {}", "{} ", " {} ", "x{}y", "a {} b", "\n{}\n", "word{}", "{}word"]


def random_text(rng: random.Random, chars: int, added: list[str]) -> str:
    """Words and gaps, with added-token text (and the demo's special tokens) spliced in beside the offsets where
    cuts are looked for."""
    parts: list[str] = []
    size = 0
    while size < chars:
        part = rng.choice(WORDS) + rng.choice(GAPS)
        if added and rng.random() < 0.03:
            part += rng.choice(AROUND).format(rng.choice(added))
        parts.append(part)
        size += len(part)
    text = "".join(parts)
    for offset in range(len(text) // STRIDE * STRIDE, 0, -STRIDE):
        if added and rng.random() < 0.7:
            at = offset + rng.randint(-24, 24)
            text = text[:at] + rng.choice(AROUND).format(rng.choice(added)) + text[at:]
    return text


def corpus(rng: random.Random) -> list[str]:
    return [random_text(rng, 400, []) for _ in range(60)]


def built(tmp_path: Path, pre_tokenizer, normalizer=None, added: bool = True) -> PreTrainedTokenizerFast:
    """A small trained BPE with the given pipeline and Qwen-like added tokens (one lstrip/rstrip, one single_word,
    one with a space inside), saved and loaded through transformers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(random.Random(1)), trainer)
    if added:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
        tokenizer.add_special_tokens([AddedToken("<mask>", special=True, normalized=False, lstrip=True,
                                                 rstrip=True)])
        tokenizer.add_tokens([AddedToken("foo", normalized=False, single_word=True),
                              AddedToken("new york", normalized=False, rstrip=True)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path)
    return PreTrainedTokenizerFast.from_pretrained(tmp_path)


def split_off(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


RECOGNISED = {
    "demo": ("gpt2", lambda tmp: AutoTokenizer.from_pretrained(ASSETS / "target")),
    "qwen2": ("qwen2", lambda tmp: built(tmp, split_off(prompt_tokens.QWEN2_REGEX), normalizers.NFC())),
    "llama3": ("cl100k", lambda tmp: built(tmp, split_off(prompt_tokens.CL100K_REGEX))),
    "gpt2-split": ("gpt2", lambda tmp: built(tmp, split_off(prompt_tokens.GPT2_REGEX))),
}


@pytest.fixture(scope="module", params=sorted(RECOGNISED))
def recognised(request, tmp_path_factory) -> tuple[PreTrainedTokenizerFast, str]:
    family, make = RECOGNISED[request.param]
    return make(tmp_path_factory.mktemp(request.param)), family


def plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_random_texts_encode_exactly_and_long_ones_are_cut(recognised):
    tokenizer, family = recognised
    cache = PromptTokens(tokenizer)
    assert cache.family == family
    rng = random.Random(0)
    cut = 0
    for _ in range(80):
        text = random_text(rng, rng.choice([300, MIN_CHARS + 10, 3000, 6000]), ADDED)
        assert cache.encode(text) == plain(tokenizer, text), text
        cut += bool(cache.cuts(text))
    assert cut >= 40  # most long texts were cut: the equality above covers cached pieces


def test_every_safe_point_splits_a_text_exactly(recognised):
    """The lemma the cache stands on, at every safe point of short texts rather than only the chosen cuts."""
    tokenizer, _ = recognised
    cache = PromptTokens(tokenizer)
    rng = random.Random(1)
    checked = 0
    for _ in range(80):
        text = random_text(rng, 250, ADDED)
        point = cache._safe_point(text, 1)
        while point is not None:
            assert plain(tokenizer, text[:point]) + plain(tokenizer, text[point:]) == plain(tokenizer, text), \
                (text, point)
            checked += 1
            point = cache._safe_point(text, point + 1)
    assert checked > 400


def test_no_cut_next_to_added_token_text(recognised):
    tokenizer, _ = recognised
    cache = PromptTokens(tokenizer)
    filler = "word " * (STRIDE // 5)
    for token in ("<|im_end|>", "<mask>"):
        text = filler[:STRIDE - 3] + f"ab {token} cd ef" + filler * 3
        cuts = cache.cuts(text)
        assert all(token not in text[c - len(token) - 1:c + len(token) + 2] for c in cuts)
        assert cache.encode(text) == plain(tokenizer, text)


def test_texts_sharing_a_prefix_reuse_its_pieces_in_either_order(recognised):
    tokenizer, _ = recognised
    rng = random.Random(2)
    for _ in range(6):
        prefix = random_text(rng, 5000, ADDED)
        texts = [prefix + random_text(rng, rng.choice([10, 500, 3000]), ADDED) for _ in range(2)]
        for order in (texts, texts[::-1]):
            cache = PromptTokens(tokenizer)
            assert cache.encode(order[0]) == plain(tokenizer, order[0]) and cache.cached_chars == 0
            fresh = cache.fresh_chars
            assert cache.encode(order[1]) == plain(tokenizer, order[1])
            # every cut at least `reach` before the prefix's end is the same in both texts
            assert cache.cached_chars >= len(prefix) - STRIDE - 2 * cache._reach - 64
            assert cache.fresh_chars - fresh == len(order[1]) - cache.cached_chars


def test_the_lru_bound_holds_and_keeps_the_most_recent():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "target")
    cache = PromptTokens(tokenizer, max_pieces=6, max_ids=2500)
    rng = random.Random(3)
    texts = [random_text(rng, 4000, ADDED) for _ in range(8)]
    for text in texts:
        assert cache.encode(text) == plain(tokenizer, text)
        assert len(cache) <= 6 and cache.ids_held <= 2500
        assert cache.ids_held == sum(len(ids) for _, ids in cache._pieces.values())
    before = cache.cached_chars
    assert cache.encode(texts[-1]) == plain(tokenizer, texts[-1])
    assert cache.cached_chars > before  # the last text's pieces are still there
    cache = PromptTokens(tokenizer, max_pieces=1)
    for text in texts:
        cache.encode(text)
        assert len(cache) == 1


def test_threads_get_the_same_ids():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "target")
    cache = PromptTokens(tokenizer, max_pieces=12)  # evictions race with hits too
    rng = random.Random(4)
    prefixes = [random_text(rng, 4000, ADDED) for _ in range(3)]
    texts = [rng.choice(prefixes) + random_text(rng, rng.choice([5, 800, 2500]), ADDED) for _ in range(48)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(cache.encode, texts * 2))
    assert got == [plain(tokenizer, t) for t in texts * 2]
    assert cache.cached_chars > 0


def metaspace(tmp_path: Path) -> PreTrainedTokenizerFast:
    """SentencePiece-style: a prefix space and spaces as ▁, which a cut at a space would change."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(corpus(random.Random(1)), trainers.BpeTrainer(vocab_size=500, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path)
    return PreTrainedTokenizerFast.from_pretrained(tmp_path)


def nfc_with_normalized_token(tmp_path: Path) -> PreTrainedTokenizerFast:
    tokenizer = built(tmp_path, split_off(prompt_tokens.QWEN2_REGEX), normalizers.NFC(), added=False)
    tokenizer.add_tokens([AddedToken("caf\u00e9 au", normalized=True)])
    return tokenizer


UNRECOGNISED = {
    "metaspace": metaspace,
    "prefix space": lambda tmp: built(tmp, pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "unknown regex": lambda tmp: built(tmp, split_off(r"\w+|\s+|[^\w\s]+")),
    "NFKC": lambda tmp: built(tmp, split_off(prompt_tokens.QWEN2_REGEX), normalizers.NFKC()),
    "NFC, a normalized added token": nfc_with_normalized_token,
    "a Python tokenizer": lambda tmp: type("Words", (), {"encode": lambda self, text, add_special_tokens: [
        len(w) for w in text.split()]})(),
}


@pytest.mark.parametrize("name", sorted(UNRECOGNISED))
def test_unrecognised_tokenizers_pass_straight_through(name, tmp_path):
    tokenizer = UNRECOGNISED[name](tmp_path)
    cache = PromptTokens(tokenizer)
    assert cache.family is None
    rng = random.Random(5)
    for _ in range(10):
        text = random_text(rng, 5000, ADDED)
        assert cache.cuts(text) == []
        assert cache.encode(text) == plain(tokenizer, text)
    assert len(cache) == 0 and cache.cached_chars == 0


# --------------------------------------------------------------------------------------------------------
# Served


@pytest.fixture(scope="module")
def demo_client():
    engine = Engine.from_pretrained(device="cpu")
    with TestClient(create_app(lambda: engine)) as client:
        wait_ready(client, within_s=60)
        yield client, engine


SOURCE = "".join(f'def scale_{i}(values, factor):\n    """Return every value times the factor."""\n'
                 "    return [value * factor for value in values]\n\n\n" for i in range(40))[:3000]  # 734 tokens


def test_served_completions_and_chats_get_their_ids_with_the_shared_prefix_from_the_cache(demo_client):
    client, engine = demo_client
    cache = client.app.state.ddtree.prompts.tokens
    assert cache.family == "gpt2"
    for tail in ("\n\ndef first(", "\n\nclass Second:"):
        prompt = SOURCE + tail
        before = cache.cached_chars
        body = {"model": "ddtree-demo", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        reply = client.post("/v1/completions", json=body | {"prompt": prompt}).json()
        ids = engine.encode(prompt)
        assert reply["prompt_token_ids"] == ids and reply["usage"]["prompt_tokens"] == len(ids)
        by_ids = client.post("/v1/completions", json=body | {"prompt": ids}).json()
        assert reply["choices"][0]["text"] == by_ids["choices"][0]["text"]
        if tail != "\n\ndef first(":
            assert cache.cached_chars - before >= len(SOURCE) - STRIDE  # mostly served from the cache
    for user in ("What does this do?", "Write a test for it."):
        messages = [{"role": "system", "content": SOURCE}, {"role": "user", "content": user}]
        before = cache.cached_chars
        body = {"model": "ddtree-demo", "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                "messages": messages}
        reply = client.post("/v1/chat/completions", json=body).json()
        ids = engine.chat_ids(messages)
        assert reply["prompt_token_ids"] == ids and reply["usage"]["prompt_tokens"] == len(ids)
        if user != "What does this do?":  # the first chat's rendered text left its pieces
            assert cache.cached_chars - before >= len(SOURCE) - STRIDE
    tokenized = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokenized == engine.chat_ids(messages)


def test_chat_template_encoding_options_keep_the_template_path(demo_client):
    client, engine = demo_client
    prompts = client.app.state.ddtree.prompts
    messages = [{"role": "system", "content": SOURCE}, {"role": "user", "content": "hi"}]
    before = prompts.tokens.fresh_chars + prompts.tokens.cached_chars
    assert prompts.chat_ids(messages, truncation=False) == engine.chat_ids(messages, truncation=False)
    assert prompts.tokens.fresh_chars + prompts.tokens.cached_chars == before


def test_a_shapes_tokenizer_encodes_through_the_cache_as_the_tokenizer_it_wraps():
    """`serve --shape` wraps the demo tokenizer (ids beyond it decode modulo its size): its prompts' prefixes are
    cached too, with the wrapped tokenizer's ids."""
    from ddtree.api.rendering import PromptRenderer
    from ddtree.models.shapes import ShapeTokenizer

    inner = AutoTokenizer.from_pretrained(ASSETS / "target")
    engine = type("ShapeEngine", (), {"tokenizer": ShapeTokenizer(inner), "encode": None})()
    renderer = PromptRenderer(engine)
    rng = random.Random(5)
    prefix = random_text(rng, 6000, [])
    for tail in ("one", "two"):
        assert renderer.text_ids(prefix + tail) == plain(inner, prefix + tail)
    assert renderer.tokens.cached_chars >= len(prefix) - STRIDE - 64
