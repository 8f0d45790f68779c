"""A grammar that compiles for a long time (minutes on a 32,000-token vocabulary: xgrammar has no
cancel), and that vocabulary as a tokenizer, for the tests of compiles past their time limit."""
from __future__ import annotations

import random
import string

from pdwire.structured_output import GrammarKind, StructuredOutput

_RULES = [f"r{i} ::= [a-z]{{1,{1000 + i}}} [0-9]{{0,{900 + i}}}" for i in range(8)]
SLOW = StructuredOutput(GrammarKind.GRAMMAR, "root ::= " + " ".join(f"r{i}" for i in range(8)) + "\n" + "\n".join(_RULES))


def wide_tokenizer(size: int = 32000):
    """A word-level tokenizer of `size` random lowercase-and-digit words; EOS is id 2."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    rng, vocab = random.Random(0), {"<unk>": 0, "<s>": 1, "</s>": 2}
    while len(vocab) < size:
        vocab.setdefault("".join(rng.choice(string.ascii_lowercase + string.digits)
                                 for _ in range(rng.randint(1, 8))), len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>", eos_token="</s>")
