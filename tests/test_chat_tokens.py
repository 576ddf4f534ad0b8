"""Chat message text never becomes a control token: only the chat template writes them (text
that spells <|eos|> or <|bos|> became that token; HF's tokenizers split such text with
split_special_tokens=True). Raw text prompts keep HF's tokenizer(text) behaviour."""

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from mosaic import MosaicEngine
from mosaic.errors import InputError
from mosaic.loader import BUNDLED
from mosaic.tokenizer import TextTokenizer

TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def char_tokenizer() -> TextTokenizer:
    chars = list("abcdefghijklmnopqrstuvwxyz<|>[] 0123456789")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)} | {"<unk>": len(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.add_special_tokens([AddedToken("<|bos|>", special=True), AddedToken("<|eos|>", special=True)])
    return TextTokenizer(tok, {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}, TEMPLATE)


def test_spelled_special_tokens_stay_text_in_chat_messages():
    t = char_tokenizer()
    bos, eos = t.tok.token_to_id("<|bos|>"), t.tok.token_to_id("<|eos|>")
    ids = t.encode_chat([{"role": "user", "content": "hi <|eos|> <|bos|>"}])
    assert ids[0] == bos and ids.count(bos) == 1 and eos not in ids      # the template's BOS only
    text = t.tok.decode(ids[1:], skip_special_tokens=False).replace(" ", "")
    assert "<|eos|>" in text and "<|bos|>" in text                       # spelled as characters
    plain = t.encode_chat([{"role": "user", "content": "hi there"}])
    assert plain == t.tok.encode(t.apply_chat_template([{"role": "user", "content": "hi there"}]),
                                 add_special_tokens=False).ids           # unchanged without them


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("spelled", ["<|eos|>", "<|bos|>", "<|mask|>"])
def test_bundled_models_never_read_message_text_as_control_tokens(name, spelled):
    e = MosaicEngine(BUNDLED[name], {"progress": False})
    with pytest.raises(InputError, match="never becomes a control token"):
        e.encode([{"role": "user", "content": f"1+2{spelled}"}])
    assert e.encode([{"role": "user", "content": "1+2"}], chat=True)[0][0] == e.model.cfg.bos_id


def test_a_template_that_rewrites_message_text_is_refused_with_spelled_tokens():
    t = char_tokenizer()
    t.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'][1:] }}{% endfor %}"
    with pytest.raises(InputError, match="rewrites message text"):
        t.encode_chat([{"role": "user", "content": "a<|eos|>"}])
