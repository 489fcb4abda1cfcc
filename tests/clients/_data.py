"""A tiny corpus and BPE tokenizer made at test time (nothing is downloaded).

`make_assets(folder)` writes `folder/tokenizer/` (a Hugging Face `tokenizer.json` trained by the
`tokenizers` package on the corpus, plus a `tokenizer_config.json` naming BOS/EOS, the layout
torchtitan's and transformers' tokenizer loaders read) and `folder/data/train.jsonl` (one
`{"text": ...}` document a line, the layout of torchtitan's `c4_test` set). The corpus is
sentences drawn from a small word list by a seeded generator, so every run and every rank get
the same bytes; training the tokenizer takes about a second.
"""

from __future__ import annotations

import json
import os
import random

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
VOCAB_SIZE = 512  # at most every model's vocabulary (torchtitan's debug models have 2048)

_WORDS = (
    "the a one every some this that model layer shard rank block expert token weight gradient "
    "buffer mesh tensor step loss norm optimizer batch sequence head query key value router "
    "sparse dense ragged whole split gather reduce scatter compute store load save train learn "
    "fast slow small large quiet bright river stone cloud forest garden window letter number "
    "runs holds keeps moves sends takes gives finds makes reads writes joins splits grows falls "
    "over under into from with without between after before during across behind beyond"
).split()


def corpus(documents: int = 2000, seed: int = 0) -> list[str]:
    """`documents` short texts of 1-4 sentences of 4-12 words each."""
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
            sentences.append(" ".join(words).capitalize() + ".")
        texts.append(" ".join(sentences))
    return texts


def make_assets(folder: str) -> dict[str, str]:
    """Write the tokenizer and the corpus under `folder`; return their paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = corpus()
    tok_dir = os.path.join(folder, "tokenizer")
    data_dir = os.path.join(folder, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True,
              "add_eos_token": False, "model_max_length": 4096,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return {"tokenizer": tok_dir, "data": data_dir}
