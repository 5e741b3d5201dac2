"""A tiny checkpoint whose chat template renders tool calls (Qwen's layout), written by
transformers and ``tokenizers`` alone (nothing downloaded): the SFT tests' policy.

The tokenizer is character level (one token per printable ASCII character) with the special
``<|im_start|>`` / ``<|im_end|>`` (``<|im_end|>`` ends a turn, ``generation_config.json``'s stop
id), so a test counts a text's tokens by its characters. :data:`TEMPLATE` writes an assistant
message's ``tool_calls`` as Hermes ``<tool_call>`` blocks and a tool message as a user turn in
``<tool_response>`` tags; every message is closed by ``<|im_end|>`` and ``"\\n"``.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

CHARS = sorted(set(string.ascii_letters + string.digits + string.punctuation + " \n"))
TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_chat_tokenizer(directory: Path):
    """Save the tokenizer, :data:`TEMPLATE` and ``generation_config.json`` to ``directory``;
    returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"],
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return fast


def write_chat_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A random two-layer Qwen3 (dense) model with :func:`write_chat_tokenizer`'s tokenizer in
    ``directory`` (512 positions), written by transformers; returns ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fast = write_chat_tokenizer(directory)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = AutoConfig.for_model("qwen3", vocab_size=len(fast), hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                                  bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory
