"""Write a tiny checkpoint that can call the example tools: a real tokenizer with a Hermes /
Qwen3-style chat template, and a random Qwen3-MoE model (nothing is downloaded).

    python examples/environments/make_checkpoint.py /tmp/env_ckpt

The tokenizer (``tokenizers`` library, saved as ``tokenizer.json``) is character level (one
token per printable ASCII character, :data:`CHARS`) with whole tokens for:

* the chat markers ``<|im_start|>`` / ``<|im_end|>`` (special; ``<|im_end|>`` ends a turn);
* the Hermes tool-call wrapper and its JSON keys, so that a random policy can find the format:
  :data:`CALL_OPEN` (``<tool_call>{"name": "calculate", "arguments": {"expression": "``, one per
  example tool), :data:`CALL_CLOSE` (``"}}</tool_call>``) and the tool-response tags.

The turn text the environment parses is still the plain Hermes format
(``<tool_call>{"name": "calculate", "arguments": {"expression": "7*3"}}</tool_call>``, read by
``replayrl.rollout.tasks.environment.hermes_tool_calls``): the merged tokens only shorten it.
The chat template (:data:`TEMPLATE`) is Qwen's layout: the tool names in a system turn, every
message closed by ``<|im_end|>`` and a ``"\\n"`` separator, tool answers as a user turn inside
``<tool_response>`` tags.

The model is ``Qwen3MoeConfig`` (2 layers, the second with 4 experts, top-2 routing) written by
transformers with random weights (``torch.manual_seed(0)``), 1024 positions.
"""
from __future__ import annotations

import json
import string
import sys
from pathlib import Path

CHARS = sorted(set(string.ascii_letters + string.digits + string.punctuation + " \n"))
SPECIAL = ["<|im_start|>", "<|im_end|>"]
CALL_OPEN = {"calculate": '<tool_call>{"name": "calculate", "arguments": {"expression": "',
             "search": '<tool_call>{"name": "search", "arguments": {"query": "'}
CALL_CLOSE = '"}}</tool_call>'
MERGED = [*CALL_OPEN.values(), CALL_CLOSE, "<tool_response>\n", "\n</tool_response>"]
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}"
    "{{- t.function.name + ': ' + t.function.description + '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tokenizer(directory: Path):
    """Save the tokenizer, chat template and ``generation_config.json`` (stop id
    ``<|im_end|>``) to ``directory``; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   additional_special_tokens=SPECIAL[:1],
                                   clean_up_tokenization_spaces=False)
    fast.add_tokens([AddedToken(t, normalized=False, special=False) for t in MERGED])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return fast


def main(out: Path) -> None:
    """Write the checkpoint directory ``out`` (config, safetensors, tokenizer)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    fast = write_tokenizer(out)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3MoeConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                            max_position_embeddings=1024, bos_token_id=eos, eos_token_id=eos,
                            pad_token_id=eos)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    print(f"wrote {out} ({len(fast)} tokens)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "out" / "checkpoint"))
