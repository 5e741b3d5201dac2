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

The model is ``Qwen3MoeConfig`` (by default 2 layers of hidden size 64, 0.11 M parameters; every
layer but the first with 4 experts, top-2 routing) written by transformers with random weights
(``torch.manual_seed(seed)``), 1024 positions. ``--hidden-size`` / ``--layers`` make a larger one
(the agentic examples use ``--hidden-size 128 --layers 4``: copying a tool's answer back needs
more capacity than the default has):

    python examples/environments/make_checkpoint.py /tmp/env_ckpt_1m --hidden-size 128 --layers 4
"""
from __future__ import annotations

import argparse
import json
import string
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


def main(out: Path, hidden_size: int = 64, layers: int = 2, seed: int = 0) -> None:
    """Write the checkpoint directory ``out`` (config, safetensors, tokenizer).

    ``hidden_size`` (a multiple of 16: 4 heads of ``hidden_size // 4``), ``layers`` (>= 2: the
    first dense, the others MoE), ``seed``: the weights' initialisation.

    Raises:
        ValueError: a ``hidden_size`` or ``layers`` outside those bounds.
    """
    if hidden_size < 16 or hidden_size % 16:
        raise ValueError(f"--hidden-size must be a positive multiple of 16, got {hidden_size}")
    if layers < 2:
        raise ValueError(f"--layers must be >= 2 (a dense layer, then MoE layers), got {layers}")
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    fast = write_tokenizer(out)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3MoeConfig(vocab_size=len(fast), hidden_size=hidden_size,
                            intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size,
                            num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=hidden_size // 4,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                            max_position_embeddings=1024, bos_token_id=eos, eos_token_id=eos,
                            pad_token_id=eos)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out} ({len(fast)} tokens, {params / 1e6:.2f} M parameters)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?",
                        default=Path(__file__).parent / "out" / "checkpoint")
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    args = parser.parse_args()
    main(args.out, args.hidden_size, args.layers, args.seed)
