"""engine/text_buffer.py against a plain str: appends, reads and cuts near the
end and anywhere, across the points where pieces are joined into chunks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text_buffer import TextBuffer

_OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.text(max_size=6)),
    st.tuples(st.just("slice"), st.integers(0, 10_000), st.integers(0, 10_000)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000)),
    st.tuples(st.just("value")),
), max_size=400)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_it_behaves_as_a_str(ops):
    buffer, model = TextBuffer(), ""
    for op in ops:
        if op[0] == "append":
            buffer.append(op[1])
            model += op[1]
        elif op[0] == "slice":
            start, end = sorted((op[1] % (len(model) + 1), op[2] % (len(model) + 1)))
            assert buffer.slice(start, end) == model[start:end]
            assert buffer.slice(start) == model[start:]
        elif op[0] == "truncate":
            length = op[1] % (len(model) + 1)
            buffer.truncate(length)
            model = model[:length]
        else:
            assert buffer.value() == model
        assert len(buffer) == len(model)
    assert buffer.value() == model


def test_a_long_text_is_read_and_cut_near_its_end():
    buffer = TextBuffer("start:")
    model = "start:"
    for i in range(1_000):                      # ~16 foldings into chunks
        piece = f"<{i}>"
        buffer.append(piece)
        model += piece
    assert buffer.slice(len(model) - 7) == "8><999>"
    assert buffer.slice(3, 40) == model[3:40]
    buffer.truncate(len(model) - 3)
    assert buffer.value() == model[:-3]
    buffer.append("!")
    assert buffer.slice(len(model) - 10) == (model[:-3] + "!")[len(model) - 10:]
