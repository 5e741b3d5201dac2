"""The embedded model's word-level tokenizer files, written without torch (the launcher writes
them for a ``--hf-checkpoint`` run on the built-in task; ``checkpoint.save_pretrained`` with
every embedded checkpoint)."""

from __future__ import annotations

from pathlib import Path

from replayrl.transport import strict_json

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")


def save_word_tokenizer(out: Path, tokens: list[str], max_length: int) -> None:
    """Word-level `tokenizers` tokenizer: whitespace split, one id per word, specials marked special.

    Writes `out/tokenizer.json` and `out/tokenizer_config.json` (creating `out`); `tokens` is
    the vocabulary in id order with `<pad>`, `<bos>`, `<eos>`. Without a decoder, `decode`
    joins the words with single spaces.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    })


def write_json(path: Path, obj: dict) -> None:
    """``obj`` as indented strict JSON (no NaN / Infinity) and a newline at ``path``."""
    path.write_text(strict_json.dumps(obj, indent=2, sort_keys=False) + "\n")
