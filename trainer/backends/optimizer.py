"""AdamW stepped by torch's own fused kernel without ``torch.optim.Optimizer``.

Why not ``torch.optim.AdamW``: its base class imports ``torch._dynamo`` (the compiler stack)
the first time a parameter group is added and on every ``step``, to mark its methods as not
compilable. A trainer process that never compiles pays ~70 MiB of RSS for it
(VmRSS before and after ``import torch._dynamo``, torch 2.13 CPU); the trainer is one of the
two torch processes of a replayrl run.
:class:`FusedAdamW` calls the same functional ``torch.optim.adamw.adamw(..., fused=True)`` that
``torch.optim.AdamW(fused=True).step`` calls, on the same state, so the numbers are torch's and
a checkpoint written by either loads into the other (``state_dict`` has torch's layout).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.optim.adamw import adamw

__all__ = ["FusedAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class FusedAdamW:
    """AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019) over one
    parameter group, with ``torch.optim.AdamW(fused=True)``'s kernel, state and state dict.

    Args:
        params: the trainable tensors (float, on one device; each gets ``grad`` from backward).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``'s.

    Attributes:
        param_groups: ``[group]``, ``group`` holding ``torch.optim.AdamW``'s settings keys and
            ``"params"`` (the tensors); a caller may change the settings between steps.
        state: ``{param: {"step": float32 scalar tensor, "exp_avg", "exp_avg_sq": like param}}``,
            filled at a parameter's first step.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        group = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                 "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                 "differentiable": False, "fused": True, "decoupled_weight_decay": True,
                 "params": list(params)}
        self.param_groups: list[dict[str, Any]] = [group]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @property
    def _params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every parameter's gradient (``set_to_none``) or zero it in place."""
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every parameter that has a gradient (torch's fused kernel);
        a parameter's moments start at zero and its step count at 0 on its first update."""
        group = self.param_groups[0]
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in self._params:
            if p.grad is None:
                continue
            state = self.state.get(p)
            if state is None:  # torch's lazy init for fused: the step count on the param's device
                state = self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
              differentiable=False, fused=True, grad_scale=None, found_inf=None,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW.state_dict()``'s layout: ``{"state": {index: {"step", "exp_avg",
        "exp_avg_sq"}}, "param_groups": [settings + "params": [indices]]}`` (tensors not
        copied)."""
        index = {id(p): i for i, p in enumerate(self._params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self._params)))
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()},
                "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or ``torch.optim.AdamW``'s): moments and step counts
        copied, cast to each parameter's dtype and device, and the saved group's settings.
        Checked whole before anything changes.

        Raises:
            ValueError: not one parameter group of this many parameters, or a state entry with
                another index, key set or shape (names the index and the key).
            KeyError / TypeError: a malformed state dict.
        """
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self._params):
            raise ValueError(f"optimizer state has {len(groups)} group(s) of "
                             f"{[len(g['params']) for g in groups]} parameters; this optimizer has "
                             f"one group of {len(self._params)}")
        position = {saved: i for i, saved in enumerate(groups[0]["params"])}
        loaded = {}
        for saved, entry in state_dict["state"].items():
            if saved not in position:
                raise ValueError(f"optimizer state entry {saved!r} names no parameter of the group")
            p = self._params[position[saved]]
            if set(entry) != {"step", *_MOMENTS}:
                raise ValueError(f"optimizer state entry {saved}: keys {sorted(entry)}, "
                                 f"expected ['exp_avg', 'exp_avg_sq', 'step']")
            for key in _MOMENTS:
                if tuple(entry[key].shape) != tuple(p.shape):
                    raise ValueError(f"optimizer state entry {saved} {key}: shape "
                                     f"{tuple(entry[key].shape)}, the parameter's is {tuple(p.shape)}")
            loaded[p] = {"step": torch.as_tensor(entry["step"], dtype=torch.float32).to(p.device).clone(),
                         **{k: entry[k].to(dtype=p.dtype, device=p.device).clone() for k in _MOMENTS}}
        settings = {k: v for k, v in groups[0].items() if k != "params"}
        self.state = loaded
        self.param_groups[0].update(settings)
