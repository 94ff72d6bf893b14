"""A tiny Hugging Face checkpoint built locally (no downloads): byte-level BPE + random Qwen2."""

import glob
import json
import os

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "data", "samples")


def _texts():
    for path in glob.glob(os.path.join(SAMPLES, "*.jsonl")):
        with open(path) as f:
            for line in f:
                yield " ".join(str(v) for v in json.loads(line).values())


def byte_level_bpe(texts, vocab_size: int, special_tokens: list):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained in memory on ``texts`` (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def build_tiny_hf(out_dir: str, vocab_size: int = 320) -> str:
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = byte_level_bpe(_texts(), vocab_size, ["<|endoftext|>"])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                     pad_token="<|endoftext|>")
    hf_tok.save_pretrained(out_dir)
    cfg = Qwen2Config(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=hf_tok.eos_token_id, torch_dtype="float32")
    Qwen2ForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    return out_dir
