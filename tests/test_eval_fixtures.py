"""Offline stand-ins for the eval tests: a tiny byte-level BPE tokenizer, a tiny Llama, and small
data files in the official LAMBADA / WikiText layouts. Imported by the other ``test_eval_*`` files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SHARED_DATA = Path(__file__).parents[2] / "shared" / "data"

LAMBADA_TEXTS = [
    "The old keeper lit the lamp every night. When the storm came, the ships still found the harbor thanks to the lamp",
    "She packed her bag, locked the door and walked to the station. The train was late again, so she bought a coffee",
    "Tom planted tomatoes in spring. By August the vines were heavy, and he gave baskets of tomatoes",
    "The children built a snowman with a carrot nose. In the morning sun the snowman slowly began to melt",
    "He read the letter twice before folding it. Then he put the letter",
]

WIKITEXT_RAW = (
    " \n"
    " = Alpha River = \n \n"
    " The Alpha River is a 12 @-@ mile river in the north . It flows into the sea @,@ near the port . \n"
    " = = Course = = \n \n"
    " The river rises in the hills ( 300 m ) and runs south . \n \n"
    " = Beta Hill = \n \n"
    " Beta Hill is a hill of 1 @.@ 5 km . Walkers say \" it is steep \" ; others disagree . \n"
    " = = = Geology = = = \n"
    " The rock is granite . \n \n"
    " = Gamma Lake = \n \n"
    " Gamma Lake is small . It freezes in winter , and fish live in it . \n"
)


def write_data_dir(root: Path) -> Path:
    """A data directory holding ``lambada_test.jsonl`` and ``wiki.test.raw`` made of the texts above."""
    (root / "lambada").mkdir(parents=True)
    (root / "wikitext-2-raw").mkdir()
    with open(root / "lambada" / "lambada_test.jsonl", "w", encoding="utf-8") as f:
        for text in LAMBADA_TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    (root / "wikitext-2-raw" / "wiki.test.raw").write_text(WIKITEXT_RAW, encoding="utf-8")
    return root


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (vocab 320, EOS id 0, no BOS) trained on the texts above."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(LAMBADA_TEXTS + [WIKITEXT_RAW], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_llama(vocab_size: int, *, seed: int = 0, max_positions: int = 512) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 64) with random FP32 weights, in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so predictions vary with the input
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Reference log-probabilities in FP64: [len(ids) - 1, vocab], row i predicting ids[i + 1]."""
    model64 = model.to(torch.float64)
    try:
        logits = model64(input_ids=torch.tensor([ids])).logits[0, :-1]
        return torch.log_softmax(logits, dim=-1)
    finally:
        model.to(torch.float32)


def lambada_reference(model, tok, texts, logprobs=token_logprobs):
    """acc and perplexity of the LAMBADA last-word task, from FP64 log-probs of the whole passage
    (``logprobs(model, ids)``: rows predicting ``ids[1:]``)."""
    lls, greedy = [], []
    for text in texts:
        context, word = text.rsplit(" ", 1)
        whole = tok.encode(f"{context} {word}")
        n_context = len(tok.encode(context))
        lp = logprobs(model, whole)
        rows = range(n_context - 1, len(whole) - 1)
        lls.append(sum(lp[r, whole[r + 1]].item() for r in rows))
        greedy.append(all(lp[r].argmax().item() == whole[r + 1] for r in rows))
    return sum(greedy) / len(greedy), math.exp(-sum(lls) / len(lls))


def test_tiny_tokenizer_round_trips_text():
    tok = tiny_tokenizer()
    text = LAMBADA_TEXTS[0]
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 0 and tok.bos_token_id is None


def test_data_dir_layout(tmp_path):
    root = write_data_dir(tmp_path)
    lines = (root / "lambada" / "lambada_test.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == LAMBADA_TEXTS
