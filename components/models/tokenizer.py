"""A character-level tokenizer in standard Hugging Face format (tokenizer.json, no remote code).

    tok = build_char_tokenizer(); tok.save_pretrained("out"); AutoTokenizer.from_pretrained("out")

Every printable ASCII character (space included) and newline is one token; anything else is `<unk>`.
Special tokens: `<pad>` (id 0), `<bos>`, `<eos>`, `<unk>`. The tokenizer adds none of them: no BOS,
because a from-scratch model does not need an anchor token and prompts stay exactly their characters;
no EOS, because training data appends it to completions (TRL's SFTTrainer does) while prompts for
generation must end without it.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]  # <pad> first: id 0
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable ASCII + "\n"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """
    >>> tok = build_char_tokenizer()
    >>> ids = tok.encode("3+4=7\\n#### 7\\n")
    >>> len(ids), tok.decode(ids)
    (13, '3+4=7\\n#### 7\\n')
    >>> len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    (100, 0, 1, 2)
    """
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token per character: the regex matches any single char, whitespace included, so spaces and
    # newlines are tokens rather than separators.
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=4096, clean_up_tokenization_spaces=False,  # " ." must stay " ."
    )
