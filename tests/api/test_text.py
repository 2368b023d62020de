"""Stop strings and incremental detokenization: what a client sees is exactly the text before the stop."""

import random

import pytest
from ddtree.api.scheduler import StopStringDetokenizer

PIECES = [b"Hello", b" wor", b"ld", b"!", b" EN", b"D", b" more", b"\xe2\x82", b"\xac", b"\n\n", b"x"]


def decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def run(ids: list[int], stop: tuple[str, ...] = (), include: bool = False) -> tuple[list[str], int, str | None]:
    """Feed ids one by one as the worker does; returns the released pieces, tokens kept and the match."""
    text = StopStringDetokenizer(decode, stop, include)
    released, kept = [], 0
    for token in ids:
        kept += 1
        if text.add(token):
            break
        released.append(text.release())
    text.flush()
    released.append(text.release(final=True))
    return released, kept, text.matched


def test_without_stop_strings_the_text_is_the_full_decode():
    ids = [0, 1, 2, 3, 7, 8, 9, 10]
    released, kept, matched = run(ids)
    assert "".join(released) == decode(ids) and kept == len(ids) and matched is None


def test_stop_string_is_never_emitted_and_cuts_the_tokens():
    released, kept, matched = run([0, 1, 2, 3, 4, 5, 6], stop=("END",))
    assert "".join(released) == "Hello world! "
    assert kept == 6  # the token completing the stop string is the last one counted
    assert matched == "END"


def test_text_that_may_start_a_stop_string_is_withheld_until_resolved():
    text = StopStringDetokenizer(decode, ("world peace",))
    text.add(0)
    assert text.release() == "Hello"
    text.add(1)  # " wor" could be the start of " world peace"... not of "world peace" here: only "wor"
    assert text.release() == " "
    text.add(2)
    assert text.release() == ""  # "world" is still a prefix of the stop string
    text.add(3)  # "world!" is not
    assert text.release() == "world!"


def test_stop_string_spanning_tokens_and_include_stop_str_in_output():
    released, kept, matched = run([0, 1, 2, 3], stop=("o w",), include=True)
    assert "".join(released) == "Hello w" and kept == 2 and matched == "o w"


def test_earliest_of_several_stop_strings_wins():
    released, _, matched = run([0, 1, 2, 3], stop=("!", "wor"))
    assert "".join(released) == "Hello " and matched == "wor"


def test_multibyte_character_split_across_tokens_is_held_until_complete():
    text = StopStringDetokenizer(decode)
    text.add(7)
    assert text.release() == ""  # half a euro sign
    text.add(8)
    assert text.release() == "€"


@pytest.mark.parametrize("stop", [("\n\n",), ("x",)])
def test_stop_in_a_later_token_after_withheld_text(stop):
    released, _, matched = run([0, 9, 10], stop=stop)
    assert "".join(released) == "Hello" + ("" if stop == ("\n\n",) else "\n\n")
    assert matched == stop[0]


def by_rounds(ids: list[int], sizes: list[int], stop: tuple[str, ...], include: bool):
    """Feed ids a round at a time as the worker does (`add_round`); returns what `run` returns."""
    text = StopStringDetokenizer(decode, stop, include)
    released, kept, at = [], 0, 0
    for size in sizes:
        round_ = ids[at:at + size]
        at += size
        taken = text.add_round(round_)
        kept += taken
        if text.matched is not None:
            break
        released.append(text.release())
    text.flush()
    released.append(text.release(final=True))
    return released, kept, text.matched


@pytest.mark.parametrize("seed", range(40))
def test_a_round_at_once_cuts_and_releases_as_token_by_token(seed):
    """One decode a round must keep exactly the tokens, text and match of one decode a token: the same cut at a
    stop string, the same text held back for a stop string's start or an incomplete character."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(PIECES)) for _ in range(rng.randint(1, 14))]
    stop = rng.choice([(), ("END",), ("o w",), ("\n\n", "x"), ("€",), ("world peace",), ("!", "wor")])
    include = rng.random() < 0.5
    sizes, left = [], len(ids)
    while left:
        sizes.append(min(left, rng.randint(1, 6)))
        left -= sizes[-1]
    one, kept, matched = run(ids, stop, include)
    rounds, kept_rounds, matched_rounds = by_rounds(ids, sizes, stop, include)
    assert (kept_rounds, matched_rounds) == (kept, matched)
    assert "".join(rounds) == "".join(one)
