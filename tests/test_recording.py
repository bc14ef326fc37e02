"""The step's text pieces are decoded incrementally: they join to the decoded output, and no decode reads more than
a few tokens, however long the output."""

from explorer.engine.recording import IncrementalText


class CountingTokenizer:
    """The tiny pair's byte tokenizer, recording how many ids each decode read."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids)


def test_pieces_join_to_the_decoded_text_and_decodes_stay_short(tiny):
    text = "naïve café, 日本語 and emoji 🙂 — " * 20  # multi-byte characters split across byte tokens
    ids = tiny.tokenizer.encode(text)
    counting = CountingTokenizer(tiny.tokenizer)
    out = IncrementalText(counting)
    pieces = [out.add(t) for t in ids]
    assert "".join(pieces) == tiny.tokenizer.decode(ids) == text
    assert "" in pieces  # a token inside a character adds nothing until the character is complete
    assert len(ids) > 500 and max(counting.lengths) <= 8  # a window of the last tokens, not the whole output
    out.reset()
    assert out.add(ids[0]) == tiny.tokenizer.decode(ids[:1])
