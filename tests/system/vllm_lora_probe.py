"""Does the installed vLLM serve a LoRA adapter on CPU? The evidence behind the refusal of
``--lora-rank`` with ``--rollout-engine vllm`` (docs/design/lora.md#lora).

Run in the vLLM venv (``VENV/bin/python tests/system/vllm_lora_probe.py moe|dense``); prints
one JSON line and exits 0 whatever vLLM does:

* ``moe``: the tiny embedded Qwen3-MoE policy (the model ``--rollout-engine vllm`` serves)
  under ``vllm.LLM(..., enable_lora=True, max_lora_rank=8)``, one request without an adapter,
  then one with a peft adapter on the attention projections (``LoRARequest``).
* ``dense``: the control, the same shapes with every MLP dense, served as a ``qwen3`` model
  (vLLM's Qwen3-MoE needs at least one MoE layer): one request with a peft adapter on every
  attention and MLP projection.

Each request's sampled-token logprobs (temperature 1, fp32) are checked against replayrl's
embedded fp32 model holding the merged weights ``W + (alpha / r) B A``, forwarded here
(independent of vLLM): ``max_abs_logprob_diff`` in the output, and against the base weights
(``max_abs_logprob_diff_to_base``: how much the adapter changes the policy). An exception is recorded as
``error`` (type and message) with ``where`` (the innermost vLLM frame).

The adapter files are peft's format, written by hand (peft is not in the vLLM venv):
``adapter_config.json`` (``peft_type``, ``r``, ``lora_alpha``, ``target_modules``) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_{A,B}.weight`` keys.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from replayrl.rollout.model.checkpoint import save_model_files
from replayrl.rollout.model.config import default_config, without_indexer
from replayrl.rollout.model.qwen3_moe import Qwen3MoeForCausalLM
from replayrl.rollout.tasks.digit_puzzle import VOCABULARY

RANK, ALPHA = 8, 16.0
PROMPT = [5, 7, 9, 11, 4, 6, 8]


def _adapter(model: Qwen3MoeForCausalLM, targets: tuple[str, ...], directory: Path) -> dict:
    """Write a peft adapter (random A [r, in] and B [out, r], seed 1) for every linear module of
    ``model`` whose last name part is in ``targets``; returns the merged state dict."""
    g = torch.Generator().manual_seed(1)
    tensors, merged = {}, {k: v.clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and ".experts." not in name:
            out_f, in_f = module.weight.shape
            a = torch.randn(RANK, in_f, generator=g) / in_f ** 0.5
            b = torch.randn(out_f, RANK, generator=g) * 0.3
            tensors[f"base_model.model.{name}.lora_A.weight"] = a
            tensors[f"base_model.model.{name}.lora_B.weight"] = b
            merged[f"{name}.weight"] = merged[f"{name}.weight"] + (ALPHA / RANK) * b @ a
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": sorted(targets),
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": ""}))
    return merged


def _reference_diff(cfg, state: dict, ids: list[int], logprobs: list[float]) -> float:
    """max |vLLM logprob - fp32 reference logprob| over the sampled tokens."""
    model = Qwen3MoeForCausalLM(cfg)
    model.load_state_dict(state)
    context = torch.tensor([PROMPT + ids[:-1]])
    with torch.no_grad():
        logits = model.eval()(context, torch.arange(context.shape[1])[None]).logits[0].double()
    ref = torch.log_softmax(logits[len(PROMPT) - 1:], -1)[torch.arange(len(ids)), torch.tensor(ids)]
    return float((torch.tensor(logprobs, dtype=torch.float64) - ref).abs().max())


def probe(kind: str) -> dict:
    """Run the probe ``kind`` (``"moe"`` or ``"dense"``); returns the JSON-able record."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm.lora.request import LoRARequest

    cfg = without_indexer(default_config(len(VOCABULARY)))
    if kind == "dense":
        cfg = dataclasses.replace(cfg, mlp_only_layers=tuple(range(cfg.num_hidden_layers)))
    targets = (("q_proj", "k_proj", "v_proj", "o_proj") if kind == "moe" else
               ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    record = {"vllm": vllm.__version__, "torch": torch.__version__, "model": kind,
              "targets": list(targets), "requests": []}
    work = Path(tempfile.mkdtemp(prefix="replayrl-vllm-lora-"))
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(0)
    save_model_files(model, work / "base")
    if kind == "dense":  # the same tensors under vLLM's dense Qwen3
        path = work / "base" / "config.json"
        hf = json.loads(path.read_text())
        hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
        path.write_text(json.dumps(hf))
    merged = _adapter(model, targets, work / "adapter")
    base = model.state_dict()
    params = vllm.SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3, detokenize=False)
    try:
        llm = vllm.LLM(str(work / "base"), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                       seed=0, enable_prefix_caching=False, max_model_len=cfg.max_position_embeddings,
                       logprobs_mode="processed_logprobs", max_logprobs=cfg.vocab_size,
                       enable_lora=True, max_lora_rank=RANK, max_loras=1)
        runs = [("base", None, base)] if kind == "moe" else []
        runs.append(("adapter", LoRARequest("probe", 1, str(work / "adapter")), merged))
        for what, request, state in runs:
            out = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=request,
                               use_tqdm=False)[0].outputs[0]
            ids = list(out.token_ids)
            lps = [lp[t].logprob for lp, t in zip(out.logprobs, ids)]
            record["requests"].append({"request": what, "tokens": ids,
                                       "max_abs_logprob_diff": _reference_diff(cfg, state, ids, lps),
                                       "max_abs_logprob_diff_to_base": _reference_diff(cfg, base, ids, lps)})
    except Exception as exc:  # the evidence: what vLLM raised, and where
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename]
        record["error"] = f"{type(exc).__name__}: {exc}"
        if frames:
            record["where"] = f"vllm/{frames[-1].filename.split('/vllm/', 1)[1]}:{frames[-1].lineno}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return record


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("moe", "dense"):
        sys.exit("usage: vllm_lora_probe.py moe|dense")
    print(json.dumps(probe(sys.argv[1])), flush=True)
