"""Committed text: the generated prefix up to the first mask, cut at end-of-text or a stop string."""

from mosaic.serve.stream import CommittedText, render_canvas

M, E = 99, 98   # mask id, end-of-text id
CHARS = {i: c for i, c in enumerate("abcdefghij")} | {10: "\ufffd"}


def decode(ids):
    ids = list(ids)
    if E in ids:
        ids = ids[: ids.index(E)]
    return "".join(CHARS[i] for i in ids if i != M)


def test_only_the_prefix_before_the_first_mask_is_sent():
    t = CommittedText(decode, E, M)
    assert t.update([M, 1, M, M]) == ""          # position 1 is final but not yet contiguous
    assert t.update([0, 1, M, 3]) == "ab"
    assert t.update([0, 1, 2, 3], final=True) == "cd"
    assert t.text == "abcd" and t.done == "length" and t.answer_tokens == 4


def test_end_of_text_ends_the_answer_before_the_canvas_is_full():
    t = CommittedText(decode, E, M)
    assert t.update([0, E, M, M]) == "a"
    assert t.done == "stop" and t.answer_tokens == 1
    assert t.update([0, E, 5, 5], final=True) == ""


def test_stop_strings_are_held_back_until_decided():
    t = CommittedText(decode, E, M, stop=["cd"])
    assert t.update([0, 1, 2, M]) == "ab"       # "c" may start "cd": held back
    assert t.update([0, 1, 2, 4], final=True) == "ce"
    t = CommittedText(decode, E, M, stop=["cd"])
    assert t.update([0, 1, 2, M, M]) == "ab"
    assert t.update([0, 1, 2, 3, M]) == ""
    assert t.done == "stop" and t.text == "ab" and t.answer_tokens == 2


def test_a_partial_character_is_held_back():
    t = CommittedText(decode, E, M)
    assert t.update([0, 10, M]) == "a"
    assert t.update([0, 1, 2], final=True) == "bc"


def test_canvas_preview_shows_masks():
    assert render_canvas(lambda ids: decode(ids), [0, M, 2, M], M) == "a_c_"
