"""Write this example's files: a tiny checkpoint directory and prompt files.

The checkpoint is made from a transformers config (``Qwen3MoeConfig``, random weights) with a
word-level tokenizer trained by the ``tokenizers`` library on the prompts, and a chat template.
The prompts ask for the larger / smaller of two numbers, in the common ``{"prompt", "label"}``
shape. Nothing is downloaded.

    python examples/own_data/make_data.py examples/own_data/out
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ["which", "is", "larger", "smaller", ":", "or", "?"] + [str(n) for n in range(10)]
TEMPLATE = ("{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} answer :{% endif %}")


def prompts(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": "which is larger : 3 or 7 ?", "label": "7"}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(range(10), 2)
        which = rng.choice(["larger", "smaller"])
        answer = max(a, b) if which == "larger" else min(a, b)
        rows.append({"prompt": f"which is {which} : {a} or {b} ?", "label": str(answer)})
    return rows


def main(out: Path) -> None:
    """Write ``out/checkpoint`` (config, safetensors, tokenizer) and ``out/{train,test}.jsonl``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    train, test = prompts(512, 0), prompts(64, 1)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    specials = ["<pad>", "<bos>", "<eos>", "answer"]
    tok = Tokenizer(models.WordLevel(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")
    fast.chat_template = TEMPLATE
    ckpt = out / "checkpoint"
    fast.save_pretrained(str(ckpt))

    config = Qwen3MoeConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                            moe_intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
                            max_position_embeddings=256, bos_token_id=fast.bos_token_id,
                            eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(str(ckpt))  # also generation_config.json
    print(f"wrote {ckpt} ({len(fast)} tokens), {len(train)} train and {len(test)} test prompts")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "out"))
