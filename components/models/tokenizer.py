"""A character-level tokenizer in standard Hugging Face format (tokenizer.json, no remote code).

    tok = build_char_tokenizer(); tok.save_pretrained("out"); AutoTokenizer.from_pretrained("out")

Every printable ASCII character and newline is one token. No BOS is prepended and no EOS appended
by the tokenizer: training data appends EOS, and prompts for generation end without it.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]  # <pad> is id 0
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """
    >>> tok = build_char_tokenizer()
    >>> tok.decode(tok.encode("3+4=7\\n#### 7\\n"))
    '3+4=7\\n#### 7\\n'
    >>> len(tok), tok.pad_token_id
    (100, 0)
    """
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.model_max_length = 4096
    return tok
